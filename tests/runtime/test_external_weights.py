"""External weights on real packages: one compiled graph, many checkpoints, zero copies."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import flashrt_build
import flashrt_build.stages.compile as compiled
from flashrt_build.config.compose import compose
from flashrt_build.config.spec import resolve_spec
from flashrt_build.runtime.checkpoint import check_checkpoint
from flashrt_build.runtime.hashing import file_sha256
from flashrt_build.stages.module import instantiate_module
from flashrt_build.stages.weights import tensor_sha256

pytestmark = pytest.mark.slow


def eager(*overrides: str) -> torch.nn.Module:
    return instantiate_module(resolve_spec(compose(list(overrides))))


def check_cli(output_dir: Path, checkpoint: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flashrt_build.check", str(output_dir), str(checkpoint)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_external_package_holds_no_weight_bytes(
    gpt2_build: flashrt_build.BuildResult, gpt2_external_build: flashrt_build.BuildResult
) -> None:
    baked, external = gpt2_build.manifest, gpt2_external_build.manifest
    weight_bytes = sum(t.numel() * t.element_size() for t in eager("+module=gpt2_tiny").state_dict().values())
    weight_bytes -= 1000 * 128 * 4  # lm_head.weight is tied to wte: stored once
    ratio = external["package"]["bytes"] / baked["package"]["bytes"]
    print(f"gpt2_tiny external/baked package size: {ratio:.3f}")
    assert ratio < 0.6
    assert external["weights"]["bytes"] >= weight_bytes
    # Each weight's bytes are in the baked package and in no file of the external one (the package sizes' difference
    # also moves with the compiled code: 95.0% of the weights' bytes in one run, 100.5% in another). Tensors of one
    # repeated byte (GPT-2's zero biases) are skipped: any binary holds those.
    sidecar = load_file(gpt2_external_build.output_dir / "weights.safetensors")
    weights = [t.contiguous().view(torch.uint8).numpy().tobytes() for t in sidecar.values()]
    weights = [raw for raw in weights if len(raw) >= 1024 and raw.count(raw[:1]) < len(raw)]
    assert len(weights) >= 10
    for build, holds in ((gpt2_build, True), (gpt2_external_build, False)):
        with zipfile.ZipFile(build.output_dir / "model.pt2") as package:
            files = [package.read(member) for member in package.infolist()]
        assert [any(raw in data for data in files) for raw in weights] == [holds] * len(weights)


def test_sidecar_holds_exactly_the_bound_tensors(gpt2_external_build: flashrt_build.BuildResult) -> None:
    m = gpt2_external_build.manifest
    sidecar = gpt2_external_build.output_dir / "weights.safetensors"
    assert m["weights"]["file"] == "weights.safetensors" and m["weights"]["sha256"] == file_sha256(sidecar)
    with safe_open(str(sidecar), framework="pt") as f:
        assert sorted(f.keys()) == sorted(t["fqn"] for t in m["weights"]["tensors"])
        for entry in m["weights"]["tensors"]:
            assert tensor_sha256(f.get_tensor(entry["fqn"])) == entry["sha256"]
    assert sorted(flashrt_build.load(gpt2_external_build.output_dir).constant_fqns()) == sorted(
        t["fqn"] for t in m["weights"]["tensors"]
    )


def test_loading_with_the_sidecar_matches_eager(
    mlp_external_build: flashrt_build.BuildResult, gpt2_external_build: flashrt_build.BuildResult
) -> None:
    x = torch.randn(9, 16)
    with torch.no_grad():
        torch.testing.assert_close(flashrt_build.load(mlp_external_build.output_dir)(x), eager("+module=mlp")(x))
        ids = torch.randint(0, 1000, (2, 17))
        out = flashrt_build.load(gpt2_external_build.output_dir)(input_ids=ids)
        torch.testing.assert_close(out.logits, eager("+module=gpt2_tiny")(input_ids=ids, use_cache=False).logits)


def test_baked_and_external_give_the_same_outputs(
    gpt2_build: flashrt_build.BuildResult, gpt2_external_build: flashrt_build.BuildResult
) -> None:
    ids = torch.randint(0, 1000, (2, 40))
    baked = flashrt_build.load(gpt2_build.output_dir)(input_ids=ids).logits
    external = flashrt_build.load(gpt2_external_build.output_dir)(input_ids=ids).logits
    torch.testing.assert_close(baked, external, rtol=1e-5, atol=1e-5)


def test_a_different_checkpoint_matches_eager_with_that_checkpoint(
    mlp_external_build: flashrt_build.BuildResult, mlp_checkpoint: Path
) -> None:
    reference = eager("+module=mlp", f"module.checkpoint={mlp_checkpoint}")
    x = torch.randn(6, 16)
    by_path = flashrt_build.load(mlp_external_build.output_dir, weights=mlp_checkpoint)
    by_state = flashrt_build.load(mlp_external_build.output_dir, weights=reference.state_dict())
    default = flashrt_build.load(mlp_external_build.output_dir)
    with torch.no_grad():
        torch.testing.assert_close(by_path(x), reference(x))
        torch.testing.assert_close(by_state(x), reference(x))
        assert not torch.allclose(default(x), reference(x))


def test_binding_a_checkpoint_after_load_fills_in_the_forwards_constants_like_load(
    mlp_external_build: flashrt_build.BuildResult, mlp_checkpoint: Path
) -> None:
    """A checkpoint holds no constant of the forward's code: bind() takes the
    build's value from the sidecar, as load() does, and keeps it bound and alive."""
    reference = eager("+module=mlp", f"module.checkpoint={mlp_checkpoint}")
    model = flashrt_build.load(mlp_external_build.output_dir)
    model.bind(reference.state_dict())
    fqns = {t["fqn"] for t in mlp_external_build.manifest["weights"]["tensors"]}
    assert set(model.bound_weights) == fqns and not fqns <= set(reference.state_dict())
    x = torch.randn(6, 16)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x))


def test_bound_tensors_are_the_callers_tensors(mlp_external_build: flashrt_build.BuildResult) -> None:
    state = {k: v.clone() for k, v in eager("+module=mlp").state_dict().items()}
    model = flashrt_build.load(mlp_external_build.output_dir, weights=state)
    assert model.bound_weights["fc1.weight"].data_ptr() == state["fc1.weight"].data_ptr()
    x = torch.randn(3, 16)
    before = model(x)
    state["fc2.bias"].add_(2.0)  # an in-place edit of the caller's tensor shows up in the output
    torch.testing.assert_close(model(x) - before, torch.full_like(before, 2.0 * 0.5))


def test_host_module_attributes_fall_through_and_its_tensors_are_bound(
    gpt2_external_build: flashrt_build.BuildResult,
) -> None:
    host = eager("+module=gpt2_tiny")
    model = flashrt_build.load(gpt2_external_build.output_dir, host=host)
    assert model.host is host
    assert model.config.n_layer == 2 and model.dtype == torch.float32  # pipeline glue keeps working
    assert isinstance(model, torch.nn.Module) and not list(model.parameters())  # the host is not a submodule
    wte = host.transformer.wte.weight
    bound = [t for t in model.bound_weights.values() if t.data_ptr() == wte.data_ptr()]
    assert len(bound) == 1
    ids = torch.randint(0, 1000, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, host(input_ids=ids, use_cache=False).logits)
        host.lm_head.weight.mul_(0.0)  # tied to wte: zero logits through the package too
        assert torch.count_nonzero(model(input_ids=ids).logits) == 0


def test_every_kind_of_mismatch_is_reported_by_name(mlp_external_build: flashrt_build.BuildResult) -> None:
    state = dict(eager("+module=mlp").state_dict())
    del state["fc1.bias"]
    state["surprise"] = torch.zeros(1)
    state["fc2.weight"] = torch.zeros(3, 3)
    state["norm.weight"] = state["norm.weight"].half()
    state["fc1.weight"] = state["fc1.weight"].to("meta")
    with pytest.raises(flashrt_build.WeightsMismatch) as info:
        flashrt_build.load(mlp_external_build.output_dir, weights=state)
    problems = info.value.problems
    assert problems["missing"] == ["fc1.bias"]
    assert problems["unexpected"] == ["surprise"]
    assert problems["wrong shape"] == ["fc2.weight [3, 3] (package expects [8, 64])"]
    assert problems["wrong dtype"] == ["norm.weight float16 (package expects float32)"]
    assert problems["wrong device"] == ["fc1.weight on meta (package runs on cpu)"]


def test_check_command_agrees_with_load(mlp_external_build: flashrt_build.BuildResult, tmp_path: Path) -> None:
    good = dict(eager("+module=mlp").state_dict())
    save_file({k: v.contiguous() for k, v in good.items()}, str(tmp_path / "good.safetensors"))
    bad = {**good, "extra": torch.zeros(2), "fc2.weight": torch.zeros(8, 32), "norm.bias": good["norm.bias"].int()}
    del bad["fc1.weight"]
    save_file({k: v.contiguous() for k, v in bad.items()}, str(tmp_path / "bad.safetensors"))
    torch.save(bad, tmp_path / "bad.pt")

    fits = check_cli(mlp_external_build.output_dir, tmp_path / "good.safetensors")
    assert fits.returncode == 0 and "fits" in fits.stdout
    flashrt_build.load(mlp_external_build.output_dir, weights=tmp_path / "good.safetensors")

    for name in ("bad.safetensors", "bad.pt"):
        result = check_cli(mlp_external_build.output_dir, tmp_path / name)
        assert result.returncode == 1
        with pytest.raises(flashrt_build.WeightsMismatch) as info:
            flashrt_build.load(mlp_external_build.output_dir, weights=tmp_path / name)
        assert check_checkpoint(mlp_external_build.output_dir, tmp_path / name) == info.value.problems
        for kind, names in info.value.problems.items():
            for item in names:
                assert f"{kind}: {item}" in result.stdout
    assert set(info.value.problems) == {"missing", "unexpected", "wrong shape", "wrong dtype"}
    assert check_cli(mlp_external_build.output_dir, tmp_path / "nope.safetensors").returncode == 2


def test_checkpoint_only_rebuild_reuses_the_package(
    mlp_external_build: flashrt_build.BuildResult, mlp_checkpoint: Path
) -> None:
    out = mlp_external_build.output_dir.parent / "swapped"
    overrides = ["+module=mlp", "weights=external", f"module.checkpoint={mlp_checkpoint}"]
    with mock.patch.object(compiled, "compile_package", wraps=compiled.compile_package) as compiler:
        start = time.perf_counter()
        result = flashrt_build.build(compose([*overrides, f"output_dir={out}", f"output_root={out.parent}"]))
        elapsed = time.perf_counter() - start
    print(f"mlp checkpoint-swap rebuild: {elapsed:.2f}s")
    assert compiler.call_count == 0
    assert "compile" not in result.manifest["timings"] and result.manifest["package"]["reused"] is True
    first = mlp_external_build.manifest
    assert result.manifest["package"]["sha256"] == first["package"]["sha256"]
    assert result.manifest["graph_key"] == first["graph_key"]
    assert result.manifest["build_key"] != first["build_key"]
    assert result.manifest["weights"]["sha256"] != first["weights"]["sha256"]
    assert result.manifest["verification"]["passed"] is True
    x = torch.randn(4, 16)
    with torch.no_grad():
        torch.testing.assert_close(flashrt_build.load(out)(x), eager(*overrides)(x))


def test_load_refuses_an_altered_sidecar(mlp_external_build: flashrt_build.BuildResult, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(mlp_external_build.output_dir, copy)
    data = bytearray((copy / "weights.safetensors").read_bytes())
    data[-3] ^= 0x01
    (copy / "weights.safetensors").write_bytes(bytes(data))
    with pytest.raises(flashrt_build.ArtifactError, match=r"weights.safetensors \(the weights\) was altered"):
        flashrt_build.load(copy)
    # A sidecar is checked when it is read: the mlp's host lacks the forward's
    # constant, which comes from the sidecar; every tensor given reads none of it.
    with pytest.raises(flashrt_build.ArtifactError, match=r"weights.safetensors \(the weights\) was altered"):
        flashrt_build.load(copy, host=eager("+module=mlp"))
    every = load_file(str(mlp_external_build.output_dir / "weights.safetensors"))
    x = torch.randn(4, 16)
    with torch.no_grad():
        torch.testing.assert_close(flashrt_build.load(copy, weights=every)(x), eager("+module=mlp")(x))


@pytest.mark.slow
def test_a_buffer_the_graph_never_reads_is_recorded_and_accepted(tmp_path: Path) -> None:
    """BatchNorm's num_batches_tracked (all of torchvision's ResNets): Inductor
    drops it; the build records it as unused and checkpoints may carry it."""
    conf = Path(__file__).resolve().parents[1] / "conf"
    out = tmp_path / "bn"
    cfg = compose(["+module=batchnorm", "weights=external", f"output_dir={out}", f"output_root={tmp_path}"], conf)
    result = flashrt_build.build(cfg)
    weights = result.manifest["weights"]
    assert weights["unused"] == ["bn.num_batches_tracked"]
    assert "bn.num_batches_tracked" not in {t["fqn"] for t in weights["tensors"]}
    assert {"bn.running_mean", "bn.running_var"} <= {t["fqn"] for t in weights["tensors"]}
    host = instantiate_module(resolve_spec(cfg))
    model = flashrt_build.load(out, host=host)  # the host's full state dict, num_batches_tracked included
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(model(x), host(x))
    checkpoint = tmp_path / "full.safetensors"
    save_file({k: v.contiguous() for k, v in host.state_dict().items()}, str(checkpoint))
    assert check_checkpoint(out, checkpoint) == {}


def test_a_files_floating_point_tensors_are_cast_the_callers_are_not(
    mlp_external_build: flashrt_build.BuildResult, tmp_path: Path
) -> None:
    """A bf16 checkpoint binds to a float32 package when read from a file
    (a copy is made anyway); the caller's own tensors are bound as they are, so
    their dtype must be the package's."""
    reference = eager("+module=mlp")
    half = {k: v.to(torch.bfloat16).contiguous() for k, v in reference.state_dict().items()}
    save_file(half, str(tmp_path / "bf16.safetensors"))
    model = flashrt_build.load(mlp_external_build.output_dir, weights=tmp_path / "bf16.safetensors")
    assert model.bound_weights["fc1.weight"].dtype == torch.float32
    torch.testing.assert_close(model.bound_weights["fc1.weight"], half["fc1.weight"].float())
    assert check_checkpoint(mlp_external_build.output_dir, tmp_path / "bf16.safetensors") == {}
    with pytest.raises(
        flashrt_build.WeightsMismatch,
        match=r"wrong dtype: fc1.bias bfloat16 \(package expects float32\), fc1.weight bfloat16",
    ):
        flashrt_build.load(mlp_external_build.output_dir, weights=half)


def test_non_contiguous_inputs_are_read_as_their_values(gpt2_external_build: flashrt_build.BuildResult) -> None:
    """A transposed, an expanded (stride 0) and a strided view of token ids:
    the package's own kernels read row-major, so each view is copied first
    (a transposed input once read 2.6 off; an expanded one past its storage)."""
    model = flashrt_build.load(gpt2_external_build.output_dir)
    torch.manual_seed(0)
    views = {
        "transposed": torch.randint(0, 1000, (7, 2)).t(),
        "expanded": torch.randint(0, 1000, (1, 7)).expand(2, 7),
        "strided": torch.randint(0, 1000, (2, 14))[:, ::2],
    }
    for name, ids in views.items():
        assert not ids.is_contiguous(), name
        torch.testing.assert_close(model(input_ids=ids), model(input_ids=ids.contiguous()), msg=name)
