"""The tool as people install it: a wheel built from this checkout, installed
into a fresh virtual environment that sees the lock's packages (linked, not
downloaded) but not this checkout, used from a directory outside it. And the
serving-only install: the same wheel without Hydra and OmegaConf."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest
import torch

import flashrt_build

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
LOCK_SITE = Path(sysconfig.get_paths()["purelib"])  # this venv's packages, installed from the lock
# What a serving host leaves out: the build extra's packages.
BUILD_ONLY = ("hydra", "hydra_core", "hydra_plugins", "hydra_joblib", "hydra_submitit", "omegaconf", "antlr4")


def run(*command: str | Path, cwd: Path | None = None, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of the checkout
    return subprocess.run(
        [str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`pip wheel` of a copy of the checkout (setuptools builds in the source tree)."""
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for name in ("flashrt_build", "conf", "cpp"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path_factory.mktemp("dist")
    built = run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", dist,
                source)  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    (found,) = dist.glob("flashrt_build-*.whl")
    return found


def fresh_venv(where: Path, wheel: Path, leave_out: tuple[str, ...] = ()) -> Path:
    """A new venv whose site-packages links the lock's packages (but neither
    this checkout's flashrt_build nor `leave_out`) and holds the wheel."""
    venv.create(where, with_pip=False)
    linked = where / "lock-packages"
    linked.mkdir()
    skip = ("flashrt_build", "__editable__", "_flashrt_build", *leave_out)
    for entry in LOCK_SITE.iterdir():
        if not entry.name.lower().replace("-", "_").startswith(skip) and entry.suffix != ".pth":
            (linked / entry.name).symlink_to(entry)
    python = where / "bin" / "python"
    site = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    (site / "lock-packages.pth").write_text(f"{linked}\n")
    installed = run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", wheel)
    assert installed.returncode == 0, installed.stderr[-3000:]
    return where


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fresh_venv(tmp_path_factory.mktemp("venv") / "env", wheel)


def test_the_wheel_carries_the_configs_the_cpp_library_and_every_package(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = [
        *(f"conf/{p.relative_to(REPO / 'conf')}" for p in (REPO / "conf").rglob("*.yaml")),
        *(f"cpp_source/{p.relative_to(REPO / 'cpp')}" for p in (REPO / "cpp").rglob("*") if p.is_file()),
        "runtime/manifest.schema.json",
        "py.typed",
    ]
    assert [m for m in shipped if f"flashrt_build/{m}" not in names] == []
    # pyproject lists the packages (to map conf/ and cpp/ into the package): none may be left out
    modules = [str(p.relative_to(REPO)) for p in (REPO / "flashrt_build").rglob("*.py") if "__pycache__" not in p.parts]
    assert [m for m in modules if m not in names] == []


def test_an_installed_tool_builds_and_loads_from_any_directory(installed: Path, tmp_path: Path) -> None:
    work = tmp_path / "anywhere"
    work.mkdir()
    tool, python = installed / "bin" / "flashrt-build", installed / "bin" / "python"
    version = run(tool, "--version", cwd=work)
    assert version.returncode == 0 and version.stdout.strip() == f"flashrt_build {flashrt_build.__version__}"

    built = run(tool, "+module=mlp", cwd=work)
    assert built.returncode == 0, built.stderr[-3000:]
    out = work / "outputs" / "mlp" / "cpu-baked-default"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["flashrt_build"] == flashrt_build.__version__
    assert manifest["verification"]["passed"] is True
    # where the user is: outputs, store and logs under the working directory, nothing in the environment
    assert (work / "outputs" / ".store").is_dir() and (work / "outputs" / ".runs").is_dir()
    assert not [p for p in installed.rglob("*") if p.name in ("outputs", ".store", ".runs", "manifest.json")]

    # the user's own config dir, its module selecting shipped groups in its defaults
    conf = work / "my_conf" / "module"
    conf.mkdir(parents=True)
    (conf / "small.yaml").write_text(
        "# @package _global_\n"
        "defaults:\n  - override /target: cpu\n  - override /inductor: default\n\n"
        "module:\n  name: small\n  model: {_target_: flashrt_build.examples.MLP, in_features: 8, hidden: 16}\n"
        "  inputs: {x: {shape: [2, 8], dynamic: {0: {min: 1, max: 4}}}}\n"
    )
    mine = run(tool, "--config-dir", work / "my_conf", "+module=small", "weights=external", cwd=work)
    assert mine.returncode == 0, mine.stderr[-3000:]
    small = work / "outputs" / "small" / "cpu-external-default"
    assert (small / "weights.safetensors").is_file()

    loaded = run(python, "-c", (
        "import torch, flashrt_build\n"
        f"print(flashrt_build.load({str(out)!r})(torch.randn(3, 16)).shape[-1], "
        f"flashrt_build.load({str(small)!r})(torch.randn(3, 8)).shape[-1], flashrt_build.__file__)"
    ), cwd=work)  # fmt: skip
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    widths, where = loaded.stdout.split()[:2], loaded.stdout.split()[2]
    assert widths == ["8", "8"] and str(installed) in where  # the installed copy, not this checkout


def test_a_cmake_project_configures_the_installed_cpp_library(installed: Path, tmp_path: Path) -> None:
    if shutil.which("cmake") is None:
        pytest.fail("cmake is not on PATH: the C++ library's tests need CMake 3.18+")
    printed = run(installed / "bin" / "python", "-m", "flashrt_build.cpp", "--cmake-dir", cwd=tmp_path)
    assert printed.returncode == 0, printed.stderr
    cmake_dir = Path(printed.stdout.strip())
    assert (cmake_dir / "CMakeLists.txt").is_file() and str(installed) in str(cmake_dir)
    project = tmp_path / "server"
    project.mkdir()
    (project / "main.cpp").write_text("#include <flashrt/package.h>\nint main() { return 0; }\n")
    (project / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.18)\nproject(server CXX)\n"
        "add_subdirectory(${FLASHRT_DIR} flashrt)\n"
        "add_executable(server main.cpp)\ntarget_link_libraries(server PRIVATE flashrt::flashrt)\n"
    )
    configured = run(
        "cmake", "-S", project, "-B", tmp_path / "build", f"-DFLASHRT_DIR={cmake_dir}",
        f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}", f"-DPython3_EXECUTABLE={installed / 'bin' / 'python'}",
    )  # fmt: skip
    assert configured.returncode == 0, configured.stdout[-3000:] + configured.stderr[-3000:]
    assert (tmp_path / "build" / "CMakeCache.txt").is_file()


def test_serving_needs_neither_hydra_nor_omegaconf(
    wheel: Path, lm_build: flashrt_build.BuildResult, tmp_path_factory: pytest.TempPathFactory
) -> None:
    serving = fresh_venv(tmp_path_factory.mktemp("serving") / "env", wheel, leave_out=BUILD_ONLY)
    python = serving / "bin" / "python"
    absent = run(python, "-c", "import hydra")
    assert absent.returncode != 0 and "No module named 'hydra'" in absent.stderr
    prompt = [[3, 1, 4, 1, 5]]
    served = run(python, "-c", (
        "import sys, torch, flashrt_build\n"
        f"model = flashrt_build.load({str(lm_build.output_dir)!r})\n"
        f"print(flashrt_build.generate(model, torch.tensor({prompt}), 6).tokens.tolist())\n"
        "assert not [m for m in sys.modules if m.split('.')[0] in ('hydra', 'omegaconf')]\n"
    ))  # fmt: skip
    assert served.returncode == 0, served.stderr[-3000:]
    expected = flashrt_build.generate(flashrt_build.load(lm_build.output_dir), torch.tensor(prompt), 6).tokens
    assert json.loads(served.stdout.strip()) == expected.tolist()
    checked = run(python, "-m", "flashrt_build.check", lm_build.output_dir, lm_build.output_dir / "weights.safetensors")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    refused = run(serving / "bin" / "flashrt-build", "+module=mlp")
    assert refused.returncode == 2 and "pip install 'flashrt_build[build]'" in refused.stderr
