"""CUDA targets and the doctor. Tests marked `gpu` run on a GPU machine (the
lent H200) and skip cleanly elsewhere; the rest check the CUDA logic without
one: config validation, the architecture refusal, the doctor's verdicts."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import flashrt_build
from flashrt_build.config.compose import compose
from flashrt_build.config.spec import TF32_TOLERANCES, resolve_spec
from flashrt_build.errors import ArtifactError, ConfigError
from flashrt_build.runtime.gpu import check_gpu_arch, fp32_precision

REPO = Path(__file__).resolve().parents[2]
H200 = {"name": "NVIDIA H200", "capability": "9.0", "index": 0}
A100 = {"name": "NVIDIA A100-SXM4-80GB", "capability": "8.0", "index": 0}


def doctor(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flashrt_build.doctor", *args], cwd=REPO, capture_output=True, text=True, timeout=600
    )


def test_cuda_device_index_and_tf32_are_validated() -> None:
    spec = resolve_spec(compose(["+module=mlp", "target=cuda", "target.device=cuda:1", "target.dtype=float32"]))
    assert spec.device == "cuda:1" and spec.tf32 is False
    tf32 = resolve_spec(compose(["+module=mlp", "target=cuda", "target.dtype=float32", "target.tf32=true"]))
    assert tf32.tf32 is True and (tf32.atol, tf32.rtol) == TF32_TOLERANCES  # TF32's precision, float16's tolerances
    bf16 = resolve_spec(compose(["+module=mlp", "target=cuda"]))
    assert bf16.tf32 is None and bf16.atol is None  # bf16 calls leave the float32 flags alone
    with pytest.raises(ConfigError, match="'target.tf32' = True: TF32 applies to float32 targets; target.dtype is bf"):
        resolve_spec(compose(["+module=mlp", "target=cuda", "target.tf32=true"]))
    assert resolve_spec(compose(["+module=mlp"])).tf32 is None  # CPU: torch's settings untouched
    with pytest.raises(ConfigError, match="'target.device' = 'cuda:x'"):
        resolve_spec(compose(["+module=mlp", "target=cuda", "target.device=cuda:x"]))
    with pytest.raises(ConfigError, match="'target.tf32' = True: TF32 is a CUDA setting"):
        resolve_spec(compose(["+module=mlp", "target.tf32=true"]))


def test_a_package_refuses_a_gpu_of_another_architecture() -> None:
    check_gpu_arch(H200, torch.device("cuda:1"), {**H200, "index": 1})  # another index, same arch: fine
    check_gpu_arch(None, torch.device("cpu"), None)
    with pytest.raises(ArtifactError, match=r"compute capability 9.0 \(NVIDIA H200\).*cuda:0 is NVIDIA A100.*8.0"):
        check_gpu_arch(H200, torch.device("cuda:0"), A100)
    with pytest.raises(ArtifactError, match="cuda:0 is not available"):
        check_gpu_arch(H200, torch.device("cuda:0"), None)


def test_fp32_precision_sets_and_restores_torch_settings() -> None:
    before = torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.fp32_precision
    with fp32_precision(True):
        assert torch.backends.cuda.matmul.fp32_precision == "tf32" == torch.backends.cudnn.fp32_precision
        with fp32_precision(False):
            assert torch.backends.cuda.matmul.fp32_precision == "ieee"
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    assert (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.fp32_precision) == before
    with fp32_precision(None):
        assert (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.fp32_precision) == before


def flags() -> tuple[str, str]:
    return torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.fp32_precision


def test_fp32_precision_is_safe_when_threads_call_at_once() -> None:
    """The flags are process-wide: a thread leaving must not restore them under
    another still inside, and a thread wanting another policy waits."""
    before = flags()
    a_inside, b_inside, a_left = (threading.Event() for _ in range(3))
    seen: dict[str, tuple[Any, Any]] = {}

    def a() -> None:
        with fp32_precision(True):
            a_inside.set()
            b_inside.wait(10)
        a_left.set()

    def b() -> None:
        a_inside.wait(10)
        with fp32_precision(True):
            b_inside.set()
            a_left.wait(10)
            seen["b after a left"] = flags()  # a restored nothing: b is still inside

    def c() -> None:
        b_inside.wait(10)
        with fp32_precision(False):  # another policy: waits for a and b to leave
            seen["c"] = flags()
            seen["c after b"] = ("b after a left" in seen,) * 2  # b recorded it before leaving

    threads = [threading.Thread(target=f) for f in (a, b, c)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert seen == {"b after a left": ("tf32", "tf32"), "c": ("ieee", "ieee"), "c after b": (True, True)}
    assert flags() == before


@pytest.mark.slow
def test_only_float32_cuda_packages_touch_the_precision_flags(mlp_build: flashrt_build.BuildResult) -> None:
    manifest = json.loads((mlp_build.output_dir / "manifest.json").read_text())
    for dtype, tf32, policy in (("bfloat16", False, None), ("float16", False, None), ("float32", True, True)):
        # tf32 False is what bf16 manifests said before: still no policy
        target = {"device": "cuda", "dtype": dtype, "tf32": tf32}
        loaded = flashrt_build.LoadedModule(None, {**manifest, "target": target}, mlp_build.output_dir, device="cuda")
        assert loaded.methods["forward"]._tf32 is policy, dtype
    model = flashrt_build.load(mlp_build.output_dir)
    seen: list[tuple[str, str]] = []
    forward = model.methods["forward"]
    direct = forward._direct
    forward._direct = lambda inputs, state: (seen.append(flags()), direct(inputs, state))[1]
    x = torch.randn(4, 16)
    with fp32_precision(True):  # the caller's own setting: a package without a policy keeps it
        model(x)
    forward._tf32 = False
    model(x)
    assert seen == [("tf32", "tf32"), ("ieee", "ieee")]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the verdict on a machine without a GPU")
def test_doctor_names_a_missing_gpu_and_a_missing_compiler() -> None:
    result = doctor("target=cuda")
    assert result.returncode == 1
    assert "FAIL  CUDA device" in result.stdout and "use target=cpu" in result.stdout
    assert "canary package: skipped" in result.stdout
    result = doctor("toolchain.cxx=no-such-g++")
    assert result.returncode == 2 and "toolchain.cxx" in result.stderr
    assert doctor("target=tpu").returncode == 2


@pytest.mark.slow
def test_doctor_passes_on_a_working_toolchain_and_builds_a_canary() -> None:
    result = doctor()
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout
    assert "ok    C++ compiler:" in lines and "ok    Python headers:" in lines
    assert "ok    canary package: built" in lines and "verified in a fresh process" in lines
    assert "all checks passed" in lines


# ---- on a GPU -------------------------------------------------------------


@pytest.fixture(scope="module")
def cuda_build(tmp_path_factory: pytest.TempPathFactory) -> flashrt_build.BuildResult:
    out = tmp_path_factory.mktemp("cuda") / "mlp"
    cfg = compose(["+module=mlp", "target=cuda", "target.dtype=float32", "target.tf32=true", f"output_dir={out}",
                   f"output_root={out.parent}"])  # fmt: skip
    return flashrt_build.build(cfg)


@pytest.mark.gpu
@pytest.mark.slow
def test_cuda_build_records_its_gpu_toolchain_and_precision(cuda_build: flashrt_build.BuildResult) -> None:
    manifest = cuda_build.manifest
    assert manifest["target"] == {"device": "cuda", "dtype": "float32", "tf32": True}
    toolchain = manifest["toolchain"]
    assert toolchain["cuda"] == torch.version.cuda and toolchain["cxx"]["version"]
    major, minor = torch.cuda.get_device_capability(0)
    assert toolchain["gpu"]["capability"] == f"{major}.{minor}"
    assert toolchain["gpu"]["name"] == torch.cuda.get_device_name(0)
    assert manifest["verification"]["passed"] is True and manifest["verification"]["gpu"]["index"] == 0


@pytest.mark.gpu
@pytest.mark.slow
def test_cuda_package_loads_on_an_explicit_index_and_matches_eager(cuda_build: flashrt_build.BuildResult) -> None:
    from flashrt_build.examples import MLP

    last = torch.cuda.device_count() - 1  # another index where the machine has one
    model = flashrt_build.load(cuda_build.output_dir, device=f"cuda:{last}")
    torch.manual_seed(0)
    eager = MLP().to(f"cuda:{last}").eval()
    x = torch.randn(5, 16, device=f"cuda:{last}")
    with torch.no_grad():
        torch.testing.assert_close(model(x), eager(x), atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.slow
def test_cuda_package_refuses_a_manifest_claiming_another_architecture(
    cuda_build: flashrt_build.BuildResult, tmp_path: Path
) -> None:
    """The architecture is in the package's own record: a manifest edited to
    claim another is refused as edited (a real other GPU: the unit test above)."""
    copy = tmp_path / "copy"
    shutil.copytree(cuda_build.output_dir, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["toolchain"]["gpu"]["capability"] = "7.0"  # as if built on a V100
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=r'was edited after its build: gpu.capability is "7.0" in it, "9.0"'):
        flashrt_build.load(copy)


@pytest.mark.gpu
@pytest.mark.slow
def test_doctor_passes_for_cuda_with_a_matching_compiler() -> None:
    result = doctor("target=cuda")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok    CUDA device: cuda:" in result.stdout and "ok    canary package" in result.stdout
