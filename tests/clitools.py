"""What CLI tests share: the build command in a real subprocess, a config
dir with a module of the test's own, a small filesystem mounted for a test."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
QUIET = {"HYDRA_FULL_ERROR": "", "FLASHRT_TRACEBACK": ""}  # the one-line messages, as users see them


def cli(
    *args: str, cwd: Path = REPO, env: dict[str, str] | None = None, timeout: int = 600
) -> subprocess.CompletedProcess[str]:
    """`python -m flashrt_build ARGS` in a fresh process."""
    return subprocess.run(
        [sys.executable, "-m", "flashrt_build", *args],
        cwd=cwd,
        env={**os.environ, **QUIET, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def module_conf(tmp_path: Path, name: str, body: str) -> Path:
    """A config dir holding `module/NAME.yaml`, for `--config-dir`."""
    conf = tmp_path / "conf"
    (conf / "module").mkdir(parents=True, exist_ok=True)
    (conf / "module" / f"{name}.yaml").write_text(body)
    return conf


@contextlib.contextmanager
def mounted(where: Path, options: str) -> Iterator[Path]:
    """A tmpfs at `where` with mount `options` (`size=1m`, `ro`); the test is
    skipped where mounting needs a root this machine does not give."""
    where.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True).returncode:
        pytest.skip(f"cannot mount a tmpfs ({options}) here (needs root)")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)
