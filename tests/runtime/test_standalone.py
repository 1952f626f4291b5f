"""A serving process needs torch and safetensors, not the build system: the
runtime loads and runs a package with Hydra and OmegaConf unimportable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import flashrt_build

pytestmark = pytest.mark.slow

SERVE = """
import sys
for name in ("hydra", "omegaconf"):
    sys.modules[name] = None  # `import hydra` now raises ImportError
import torch
import flashrt_build
model = flashrt_build.load(sys.argv[1])  # external weights: the sidecar is read and bound
out = model(torch.ones(3, 16))
assert out.shape == (3, 8), out.shape
from flashrt_build.runtime.checkpoint import check_checkpoint
assert check_checkpoint(sys.argv[1], sys.argv[1] + "/weights.safetensors") == {}
leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("hydra", "omegaconf") and sys.modules[m] is not None)
assert not leaked, leaked
print("served", float(out.sum()))
"""


def test_the_runtime_serves_a_package_without_hydra_or_omegaconf(mlp_external_build: flashrt_build.BuildResult) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SERVE, str(mlp_external_build.output_dir)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    expected = float(flashrt_build.load(mlp_external_build.output_dir)(__import__("torch").ones(3, 16)).sum())
    assert done.stdout.strip() == f"served {expected}"


def test_the_build_command_without_the_build_extra_says_how_to_install_it(tmp_path: Path) -> None:
    blocked = "import sys; sys.modules['hydra'] = None; sys.argv = ['flashrt-build', '+module=mlp']\n"
    blocked += "from flashrt_build.__main__ import main; main()"
    done = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "pip install 'flashrt_build[build]'" in done.stderr
