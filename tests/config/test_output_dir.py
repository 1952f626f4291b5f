"""A build replaces its output directory whole: what it may replace is
decided before any work, and a folder of someone's files always survives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flashrt_build.artifact import SCHEMA
from flashrt_build.cache.publish import publish
from flashrt_build.config.compose import compose
from flashrt_build.config.spec import resolve_spec
from flashrt_build.errors import ConfigError
from flashrt_build.runtime.hashing import file_record

REPO = Path(__file__).resolve().parents[2]


def user_files(folder: Path) -> dict[str, str]:
    """A real folder of someone's files, nested, and a snapshot to compare with."""
    (folder / "notes").mkdir(parents=True)
    (folder / "thesis.tex").write_text("\\section{Results}")
    (folder / "notes" / "todo.txt").write_text("back up the thesis")
    return snapshot(folder)


def snapshot(folder: Path) -> dict[str, str]:
    """Every file's text by relative path (Hydra's own run logs, `.runs/`, aside)."""
    files = (p for p in sorted(folder.rglob("*")) if p.is_file() and ".runs" not in p.relative_to(folder).parts)
    return {str(p.relative_to(folder)): p.read_text() for p in files}


def fake_build(folder: Path) -> None:
    """What a build leaves: a manifest of this tool's schema and the package it lists."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.pt2").write_bytes(b"package")
    package = {"file": "model.pt2", **file_record(folder / "model.pt2")}
    (folder / "manifest.json").write_text(json.dumps({"schema": SCHEMA, "name": "mlp", "package": package}))


def refusal(tmp_path: Path, output_dir: str, cwd: Path | None = None, root: Path | None = None) -> ConfigError:
    cfg = compose(["+module=mlp", f"output_dir={output_dir}", f"output_root={root or tmp_path / 'outputs'}"])
    with pytest.raises(ConfigError) as info:
        resolve_spec(cfg, cwd or tmp_path)
    assert info.value.key == "output_dir"
    return info.value


def test_a_folder_of_user_files_is_refused_and_survives(tmp_path: Path) -> None:
    before = user_files(tmp_path / "mine")
    error = refusal(tmp_path, str(tmp_path / "mine"))
    assert "holds 2 entries that are not part of a flashrt_build artifact (notes, thesis.tex)" in str(error)
    assert "must be empty, new, or hold an earlier build" in str(error)
    assert snapshot(tmp_path / "mine") == before


def test_a_build_with_a_users_file_added_is_refused_naming_the_file(tmp_path: Path) -> None:
    fake_build(tmp_path / "build")
    (tmp_path / "build" / "notes.txt").write_text("mine")
    assert "(notes.txt)" in str(refusal(tmp_path, str(tmp_path / "build")))


def test_a_directory_whose_manifest_is_not_this_tools_is_refused(tmp_path: Path) -> None:
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "manifest.json").write_text(json.dumps({"schema": "someone-else/2"}))
    assert "(manifest.json)" in str(refusal(tmp_path, str(tmp_path / "other")))


@pytest.mark.parametrize(
    ("where", "needle"),
    [
        (lambda tmp, cwd: ".", "is the current directory"),
        (lambda tmp, cwd: str(cwd.parent), "contains the current directory"),
        (lambda tmp, cwd: "/", "is the filesystem root"),
        (lambda tmp, cwd: str(Path.home()), "is the home directory"),
        (lambda tmp, cwd: str(tmp / "data" / "outputs"), "is output_root"),
        (lambda tmp, cwd: str(tmp / "data"), "contains output_root"),
    ],
    ids=["cwd", "above-cwd", "root", "home", "output-root", "above-output-root"],
)
def test_places_a_build_must_never_replace(tmp_path: Path, where, needle: str) -> None:
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    error = refusal(tmp_path, where(tmp_path, checkout), cwd=checkout, root=tmp_path / "data" / "outputs")
    assert needle in str(error) and "give it a directory of its own" in str(error)


def test_a_symlink_is_judged_by_its_target(tmp_path: Path) -> None:
    before = user_files(tmp_path / "mine")
    (tmp_path / "link").symlink_to(tmp_path / "mine")
    error = refusal(tmp_path, str(tmp_path / "link"))
    assert f"(resolved: {tmp_path / 'mine'})" in str(error) and "thesis.tex" in str(error)
    assert snapshot(tmp_path / "mine") == before and (tmp_path / "link").is_symlink()
    # a link to an earlier build is fine: the build lands in the target
    fake_build(tmp_path / "real-build")
    (tmp_path / "build-link").symlink_to(tmp_path / "real-build")
    spec = resolve_spec(compose(["+module=mlp", f"output_dir={tmp_path / 'build-link'}"]), tmp_path)
    assert spec.output_dir == tmp_path / "real-build"


def test_empty_new_and_earlier_builds_are_accepted(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    fake_build(tmp_path / "earlier")
    for name in ("empty", "new", "earlier"):
        spec = resolve_spec(compose(["+module=mlp", f"output_dir={tmp_path / name}"]), tmp_path)
        assert spec.output_dir == tmp_path / name


def test_publishing_rechecks_what_it_would_swap_out(tmp_path: Path) -> None:
    """Files that appear in the output directory during a build are not swapped out at its end."""
    staging = tmp_path / ".staging"
    fake_build(staging)
    before = user_files(tmp_path / "out")
    with pytest.raises(ConfigError, match="now holds entries that are not part of a flashrt_build artifact"):
        publish(staging, tmp_path / "out")
    assert snapshot(tmp_path / "out") == before and (staging / "manifest.json").is_file()


@pytest.mark.parametrize("swap", ["renameat2", "two-renames"])
def test_publishing_replaces_an_earlier_build_whole(tmp_path: Path, swap: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The new build takes the old one's place and nothing of either is left
    beside it, by an atomic swap or, where the libc has none, two renames."""
    import ctypes

    if swap == "two-renames":
        monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: (_ for _ in ()).throw(OSError("no libc here")))
    out, staging = tmp_path / "out", tmp_path / ".out.staging-1"
    fake_build(out)
    fake_build(staging)
    (staging / "model.pt2").write_bytes(b"the new package")
    package = {"file": "model.pt2", **file_record(staging / "model.pt2")}
    (staging / "manifest.json").write_text(json.dumps({"schema": SCHEMA, "name": "mlp", "package": package}))
    publish(staging, out)
    assert (out / "model.pt2").read_bytes() == b"the new package"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # neither the staging nor the old build remains


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "flashrt_build", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_the_cli_refuses_before_any_work_and_every_file_survives(tmp_path: Path) -> None:
    """output_dir=. from a checkout, a folder of files, output_dir=output_root
    holding builds and their store: exit 2, one line, nothing touched."""
    checkout = tmp_path / "checkout"
    checkout_files = user_files(checkout)
    root = tmp_path / "outputs"
    fake_build(root / "mlp" / "cpu-baked-default")
    (root / ".store" / "artifacts").mkdir(parents=True)
    root_files = snapshot(root)
    mine_files = user_files(tmp_path / "mine")
    for output_dir, needle in [
        (".", "is the current directory"),
        (str(tmp_path / "mine"), "holds 2 entries that are not part of a flashrt_build artifact"),
        (str(root), "is output_root"),
    ]:
        result = cli("+module=mlp", f"output_dir={output_dir}", f"output_root={root}", cwd=checkout)
        assert result.returncode == 2, result.stderr
        assert "config key 'output_dir'" in result.stderr and needle in result.stderr
        assert "Traceback" not in result.stderr and "instantiate" not in result.stderr
    assert snapshot(checkout) == checkout_files and snapshot(tmp_path / "mine") == mine_files
    assert snapshot(root) == root_files
    assert not list(tmp_path.glob(".*.lock")) and not list(checkout.parent.glob(".staging-*"))
