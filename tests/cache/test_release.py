"""Reproducible release builds: same config, same toolchain, same bytes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from flashrt_build.runtime.hashing import file_sha256

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def release_build(out: Path, *overrides: str, cwd: Path = REPO, cache: Path | None = None) -> dict:
    env = dict(os.environ)
    if cache is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(cache)  # a cold Inductor cache somewhere else
    result = subprocess.run(
        [sys.executable, "-m", "flashrt_build", *overrides, "release=true", f"output_dir={out}", "verify.repeat=0"],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return json.loads((out / "manifest.json").read_text())


def files(directory: Path) -> dict[str, str]:
    return {p.name: file_sha256(p) for p in sorted(directory.iterdir()) if p.name != "manifest.json"}


@pytest.fixture(scope="session")
def release_pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    pairs = {}
    for name, overrides in {"mlp": ["+module=mlp"], "gpt2_tiny": ["+module=gpt2_tiny", "weights=external"]}.items():
        tmp = tmp_path_factory.mktemp(f"release_{name}")
        (tmp / "elsewhere").mkdir()
        warm = tmp / "warm"
        cold = tmp / "cold"
        release_build(warm, *overrides)
        release_build(cold, *overrides, cwd=tmp / "elsewhere", cache=tmp / "cold-cache")
        pairs[name] = (warm, cold)
    return pairs


@pytest.mark.parametrize("name", ["mlp", "gpt2_tiny"])
def test_two_release_builds_are_byte_identical(release_pairs: dict[str, tuple[Path, Path]], name: str) -> None:
    warm, cold = release_pairs[name]
    assert files(warm) == files(cold)
    expected = {"model.pt2", "weights.safetensors"} if name == "gpt2_tiny" else {"model.pt2"}
    assert set(files(warm)) == expected
    manifest = json.loads((warm / "manifest.json").read_text())
    assert manifest["release"] is True
    assert manifest["inductor"]["options"]["cpp.march"] == "x86-64-v3"  # portable, not -march=native
    assert manifest["inductor"]["options"]["aot_inductor.enable_line_tables"] is False
    assert manifest["build_key"] == json.loads((cold / "manifest.json").read_text())["build_key"]
    toolchain = manifest["toolchain"]
    assert toolchain["hydra_core"] and toolchain["omegaconf"] and toolchain["cxx"]["version"] != "unknown"
    assert toolchain["lock"]["sha256"] == file_sha256(REPO / "requirements.lock")


def repro(directory: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flashrt_build.repro", str(directory)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip


def test_repro_passes_on_a_release_build_and_names_an_altered_member(
    release_pairs: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    warm, _ = release_pairs["mlp"]
    ok = repro(warm)
    assert ok.returncode == 0 and "byte-identical" in ok.stdout

    altered = tmp_path / "altered"
    shutil.copytree(warm, altered)
    package = altered / "model.pt2"
    with zipfile.ZipFile(warm / "model.pt2") as source, zipfile.ZipFile(package, "w") as target:
        for info in source.infolist():
            data = source.read(info)
            if info.filename.endswith("wrapper.cpp"):
                member, data = info.filename, data + b"\n// changed after the build\n"
            target.writestr(info, data)
    bad = repro(altered)
    assert bad.returncode == 1
    assert f"model.pt2: {member}" in bad.stdout


def test_repro_refuses_a_non_release_build(mlp_build) -> None:  # noqa: ANN001
    result = repro(mlp_build.output_dir)
    assert result.returncode == 2 and "not a release build" in result.stderr
