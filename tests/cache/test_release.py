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


def inductor_cache_at(cache: Path | None) -> dict[str, str]:
    """This process's environment, with Inductor's cache at `cache` (a cold one somewhere else) when given."""
    return dict(os.environ) | ({"TORCHINDUCTOR_CACHE_DIR": str(cache)} if cache is not None else {})


def release_build(out: Path, *overrides: str, cwd: Path = REPO, cache: Path | None = None) -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "flashrt_build", *overrides, "release=true", f"output_dir={out}", "verify.repeat=0"],
        cwd=cwd, env=inductor_cache_at(cache), capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return json.loads((out / "manifest.json").read_text())


def files(directory: Path) -> dict[str, str]:
    return {p.name: file_sha256(p) for p in sorted(directory.iterdir()) if p.name != "manifest.json"}


@pytest.fixture(scope="session")
def release_builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Release builds of mlp (baked) and gpt2_tiny (external weights), and
    gpt2_tiny again with a cold Inductor cache from another working
    directory. mlp's second build is repro's, also cold and elsewhere."""
    tmp = tmp_path_factory.mktemp("release")
    (tmp / "elsewhere").mkdir()
    builds = {"mlp": tmp / "mlp", "gpt2_tiny": tmp / "gpt2_tiny", "gpt2_tiny_cold": tmp / "gpt2_tiny_cold"}
    release_build(builds["mlp"], "+module=mlp")
    release_build(builds["gpt2_tiny"], "+module=gpt2_tiny", "weights=external")
    release_build(
        builds["gpt2_tiny_cold"], "+module=gpt2_tiny", "weights=external", cwd=tmp / "elsewhere", cache=tmp / "cold"
    )
    return builds


def test_two_release_builds_are_byte_identical(release_builds: dict[str, Path]) -> None:
    warm, cold = release_builds["gpt2_tiny"], release_builds["gpt2_tiny_cold"]
    assert files(warm) == files(cold)
    assert set(files(warm)) == {"model.pt2", "weights.safetensors"}
    keys = [json.loads((build / "manifest.json").read_text())["build_key"] for build in (warm, cold)]
    assert keys[0] == keys[1]


@pytest.mark.parametrize("name", ["mlp", "gpt2_tiny"])
def test_a_release_build_is_portable_and_records_its_toolchain(release_builds: dict[str, Path], name: str) -> None:
    manifest = json.loads((release_builds[name] / "manifest.json").read_text())
    assert manifest["release"] is True
    assert manifest["inductor"]["options"]["cpp.march"] == "x86-64-v3"  # portable, not -march=native
    assert manifest["inductor"]["options"]["aot_inductor.enable_line_tables"] is False
    toolchain = manifest["toolchain"]
    assert toolchain["hydra_core"] and toolchain["omegaconf"] and toolchain["cxx"]["version"] != "unknown"
    assert toolchain["lock"]["sha256"] == file_sha256(REPO / "requirements.lock")


def repro(directory: Path, cwd: Path | None = None, cache: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flashrt_build.repro", str(directory)],
        cwd=cwd, env=inductor_cache_at(cache), capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip


def test_repro_passes_on_a_release_build_and_names_an_altered_member(
    release_builds: dict[str, Path], tmp_path: Path
) -> None:
    warm = release_builds["mlp"]
    (tmp_path / "elsewhere").mkdir()
    # a cold Inductor cache and another working directory: the rebuild shares nothing with the build
    ok = repro(warm, cwd=tmp_path / "elsewhere", cache=tmp_path / "cold")
    assert ok.returncode == 0 and "byte-identical" in ok.stdout, ok.stderr[-3000:]

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


def test_repro_runs_no_code_a_forged_manifest_names_unless_trusted(
    release_builds: dict[str, Path], tmp_path: Path
) -> None:
    """A manifest is the artifact's word: its config widening the allow-list
    (a target that truncates a file), naming an import path or a compiler
    that is a script, is set aside and said; the rebuild runs none of it."""
    from flashrt_build.runtime.hashing import config_sha256

    forged = tmp_path / "forged"
    shutil.copytree(release_builds["mlp"], forged)
    victim, marker = tmp_path / "victim.txt", tmp_path / "ran"
    victim.write_text("mine")
    script = tmp_path / "cxx.sh"
    script.write_text(f'#!/bin/sh\ntouch {marker}\nexec g++ "$@"\n')
    script.chmod(0o755)
    manifest = json.loads((forged / "manifest.json").read_text())
    config = manifest["config"]
    config["allowed_targets"] = ["zipfile.*"]
    config["module"]["model"] = {"_target_": "zipfile.ZipFile", "file": str(victim), "mode": "w"}
    config["toolchain"]["cxx"] = str(script)
    manifest["config_sha256"] = config_sha256(config)
    (forged / "manifest.json").chmod(0o644)
    (forged / "manifest.json").write_text(json.dumps(manifest))
    done = repro(forged)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "allowed_targets=['zipfile.*']" in done.stderr and "not used" in done.stderr and "--trust" in done.stderr
    assert "toolchain.cxx" in done.stderr and "zipfile.ZipFile" in done.stderr  # refused by the release's own list
    assert victim.read_text() == "mine" and not marker.exists()


def test_a_forged_manifests_inductor_options_run_no_compiler_and_name_no_code(
    release_builds: dict[str, Path], tmp_path: Path
) -> None:
    """The compiler is chosen by toolchain.cxx alone: `cpp.cxx` in any set of
    Inductor options (the group's, a recipe's, a method's) is refused before
    any work; an option naming other code (a CUTLASS tree) is set aside by
    repro and said."""
    from flashrt_build.runtime.hashing import config_sha256

    marker = tmp_path / "ran"
    script = tmp_path / "cxx.sh"
    script.write_text(f'#!/bin/sh\ntouch {marker}\nexec g++ "$@"\n')
    script.chmod(0o755)
    for where, says in (("inductor", "'inductor.options.cpp.cxx'"), ("quant", "'quant.inductor.options.cpp.cxx'")):
        forged = tmp_path / f"forged_{where}"
        shutil.copytree(release_builds["mlp"], forged)
        manifest = json.loads((forged / "manifest.json").read_text())
        node = manifest["config"]["inductor"] if where == "inductor" else manifest["config"]["quant"]["inductor"]
        node["options"] = {"cpp.cxx": str(script), "cuda.cutlass_dir": str(tmp_path),
                           "aot_inductor.compile_wrapper_opt_level": f"O1 -wrapper {script}"}  # fmt: skip
        manifest["config_sha256"] = config_sha256(manifest["config"])
        (forged / "manifest.json").chmod(0o644)
        (forged / "manifest.json").write_text(json.dumps(manifest))
        done = repro(forged)
        assert done.returncode == 2 and says in done.stderr and "chosen by toolchain.cxx" in done.stderr, done.stderr
        assert "Inductor option cuda.cutlass_dir" in done.stderr and "not used (it may name code)" in done.stderr
        assert "Inductor option aot_inductor.compile_wrapper_opt_level=O1 -wrapper" in done.stderr
    assert not marker.exists()
