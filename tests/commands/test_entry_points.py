"""Every documented entry point, pinned: the commands, the console script, the
public API and the manifest's contract. Scripts outside the repo call these;
a reorganisation of the package must not move them."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import flashrt_build

REPO = Path(__file__).resolve().parents[2]


def run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("module", "usage"),
    [
        ("flashrt_build", "python -m flashrt_build +module=NAME"),
        ("flashrt_build.doctor", "python -m flashrt_build.doctor [target=cuda]"),
        ("flashrt_build.check", "usage: python -m flashrt_build.check [-h] output_dir checkpoint"),
        ("flashrt_build.repro", "usage: python -m flashrt_build.repro"),
        ("flashrt_build.store", "usage: python -m flashrt_build.store [-h] [--all] {clean} [output_root]"),
    ],
)
def test_each_documented_command_answers_help(module: str, usage: str) -> None:
    result = run(sys.executable, "-m", module, "--help")
    assert result.returncode == 0, result.stderr
    assert usage in result.stdout


def test_the_console_script_is_the_build_command() -> None:
    script = Path(sys.executable).parent / "flashrt-build"
    result = run(str(script), "--help")
    assert result.returncode == 0 and "python -m flashrt_build +module=NAME" in result.stdout


def test_every_command_is_found_from_the_first_ones_help() -> None:
    """`flashrt-build --help` names each command, and `flashrt-build NAME --help` runs it."""
    from flashrt_build.__main__ import COMMANDS

    script = Path(sys.executable).parent / "flashrt-build"
    listed = run(str(script), "--help").stdout
    assert "See README.md" not in listed  # an installed user has none
    for name, (module, _) in COMMANDS.items():
        assert f"flashrt-build {name} " in listed, name
        helped = run(str(script), name, "--help")
        assert helped.returncode == 0 and "python -m flashrt_build." in helped.stdout, (name, helped.stderr)
        assert importlib.import_module(module).main is not None


def test_the_public_api_survives_importing_every_module() -> None:
    """A submodule named like an export (a `load.py` beside `load()`) would
    replace the function once imported; importing all of them must not."""
    for info in pkgutil.walk_packages(flashrt_build.__path__, "flashrt_build."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)
    from flashrt_build.config.compose import compose
    from flashrt_build.pipeline import build
    from flashrt_build.runtime.checkpoint import check_checkpoint
    from flashrt_build.runtime.load import LoadedModule, load

    assert flashrt_build.load is load and callable(flashrt_build.load)
    assert flashrt_build.build is build and flashrt_build.compose is compose
    assert flashrt_build.LoadedModule is LoadedModule and flashrt_build.check_checkpoint is check_checkpoint
    from flashrt_build.runtime.generate import generate  # beside `python -m flashrt_build.generate`

    assert flashrt_build.generate is generate
    for name in flashrt_build.__all__:
        assert getattr(flashrt_build, name) is not None


@pytest.mark.slow
def test_the_manifest_keeps_its_schema_and_fields(mlp_build: flashrt_build.BuildResult) -> None:
    manifest = mlp_build.manifest
    assert manifest["schema"] == "flashrt_build.manifest/1"
    for field in (
        "name", "module", "package", "weights", "inputs", "outputs", "target", "inductor", "release", "config",
        "config_sha256", "build_key", "toolchain", "verification", "timings",
    ):  # fmt: skip
        assert field in manifest, field
    assert {"target", "source_sha256"} <= set(manifest["module"])
    assert {"file", "sha256", "bytes"} <= set(manifest["package"])
    assert {"mode", "file", "sha256", "tensors"} <= set(manifest["weights"])
    assert {"fqn", "shape", "dtype", "kind", "sha256"} <= set(manifest["weights"]["tensors"][0])
    assert {"name", "shape", "dtype", "dynamic"} <= set(manifest["inputs"][0])
    assert {"shape", "dtype"} <= set(manifest["outputs"][0])
    assert {"torch", "python", "cxx", "cuda", "gpu", "cpu_isa", "platform"} <= set(manifest["toolchain"])
    assert {"passed", "atol", "rtol", "probes"} <= set(manifest["verification"])
