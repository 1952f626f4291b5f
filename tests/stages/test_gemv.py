"""The `gemv` pass (`passes.gemv=true`): the Triton kernel's sums equal
`linear`'s (run in Triton's interpreter here; compiled on a GPU), a CUDA
decode graph calls it for every float linear layer while prefill's dynamic
prompt keeps its GEMMs, and a CPU target takes no layer."""

from __future__ import annotations

import fnmatch
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from fresh_process import in_fresh_process
from test_passes import exported_after_passes, llama, llm_overrides  # noqa: F401  (llama: the fixture)

from flashrt_build.cache.plan import make_plan
from flashrt_build.config.compose import compose
from flashrt_build.stages.custom_ops import triton_calls
from flashrt_build.stages.gemv import gemv_weights, takes_gemv
from flashrt_build.stages.module import instantiate_stage
from flashrt_build.stages.passes import passes_stage

LAYERS = 2 * 4 + 1  # the llama family's 2 layers (fused q/k/v, o, fused gate/up, down) and the lm_head


def test_the_gemv_kernel_sums_as_linear_does_in_the_triton_interpreter() -> None:
    """Odd output sizes (a partial block of rows), K past one block and short
    of one, with and without a bias, bf16 and fp32: within each dtype's rounding (fp32: of its sums)."""
    script = textwrap.dedent(
        """
        import torch
        from flashrt_build.stages.gemv import gemv_op
        torch.manual_seed(0)
        for n, k, bias, dtype in [(7, 40, True, torch.bfloat16), (33, 2100, False, torch.bfloat16),
                                  (5, 1024, True, torch.float32), (1, 3000, False, torch.float32)]:
            w, x = torch.randn(n, k, dtype=dtype), torch.randn(1, 1, k, dtype=dtype)
            b = torch.randn(n, dtype=dtype) if bias else None
            y = gemv_op()(x, w, b)
            exact = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
            assert y.shape == (1, 1, n) and y.dtype == dtype, (y.shape, y.dtype)
            ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -16  # an output rounding; fp32 sums
            err = ((y.double() - exact).abs() / exact.abs().clamp(min=1.0)).max().item()
            assert err <= ulp, (n, k, bias, dtype, err)
        print("ok")
        """
    )
    in_fresh_process(script)


def test_the_layers_a_quant_rule_keeps_float_or_int8_per_row_take_it_a_fused_one_by_its_members_names(
    llama: tuple[Path, Path],  # noqa: F811
) -> None:
    """Decided as the quantize stage decides them: `*self_attn.?_proj`
    quantizes q, k, v and o with one scale a tensor (not the kernel's),
    `*down_proj` int8 with a scale a row (the kernel's), `*` keeps the rest
    (the fused gate/up layer by its members' names, which `*` matches)."""
    model_dir, root = llama
    rules = (
        "[{pattern: '*self_attn.?_proj', config: Int8WeightOnlyConfig, args: {granularity: per_tensor}}, "
        "{pattern: '*down_proj', config: Int8WeightOnlyConfig}, {pattern: '*', config: skip}]"
    )
    plan = make_plan(compose(llm_overrides(model_dir, root, "passes=llm", "quant=int8_wo", f"quant.rules={rules}")))
    module = instantiate_stage(plan.spec, plan.digests).value
    passes_stage(module, plan.spec)
    linears = {name: m for name, m in module.named_modules() if isinstance(m, torch.nn.Linear)}
    taken = sorted(name for name, layer in linears.items() if takes_gemv(name, layer, plan.spec))
    # q, k and v stay apart (fused, one scale would stand for three tensors' values: fuse_projections keeps them)
    assert taken == sorted(name for name in linears if not fnmatch.fnmatchcase(name, "*self_attn.?_proj"))
    assert len(taken) == 2 * 2 + 1  # each layer's gate/up and down, the lm_head
    # int8_wo's own rules: every layer, the lm_head float, the rest int8 rows; int8_dq_prefill's too (its
    # decode is int8_wo's: prefill's int8 activations are its many-row calls', which take no GEMV)
    for recipe in ("int8_wo", "int8_dq_prefill"):
        plan = make_plan(compose(llm_overrides(model_dir, root, "passes=llm", f"quant={recipe}")))
        reads = {name: gemv_weights(name, layer, plan.spec) for name, layer in linears.items()}
        assert reads == {name: "float" if name == "lm_head" else "int8" for name in linears}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_decode_graph_calls_the_gemv_for_each_float_layer_and_prefill_none(
    llama: tuple[Path, Path],  # noqa: F811
) -> None:
    model_dir, root = llama
    plan, exported = exported_after_passes(model_dir, root, "target=cuda", "passes=llm", "passes.gemv_fusion=false")
    calls = {e.method.name: triton_calls(e.program).get("flashrt::gemv", 0) for e in exported}
    assert calls == {"prefill": 0, "decode": LAYERS}
    # gemv_fusion (on in llm) takes every one's norm, gate or residual add into it (test_gemv_fusion.py)
    fusion = ("target=cuda", "passes=llm")
    plan, exported = exported_after_passes(model_dir, root, *fusion)
    calls = {e.method.name: triton_calls(e.program) for e in exported}
    assert calls["decode"] == {"flashrt::gemv_fused": LAYERS, "flashrt::decode_attention": 2} and not calls["prefill"]
    # int8_wo's layers take it too, as int8 rows (the lm_head, which int8_wo keeps float, as its float weights)
    plan, exported = exported_after_passes(model_dir, root, *fusion, "quant=int8_wo")
    decode = next(e for e in exported if e.method.name == "decode")
    assert triton_calls(decode.program)["flashrt::gemv_fused"] == LAYERS


def test_the_gemv_probe_launches_the_kernel_as_it_is_now() -> None:
    """The GPU probe (bench/gemv_fusion_probe.py) calls the kernel itself: its
    numerics check, in Triton's interpreter, fails if the kernel's arguments
    moved on without it (a GPU session would find out only when it ran)."""
    probe = Path(__file__).resolve().parents[2] / "bench" / "gemv_fusion_probe.py"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(probe), "--check"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and "int8 rows agree with their reference" in done.stdout, done.stderr[-3000:]


@pytest.mark.parametrize("probe", ["gemv_dot_probe.py", "gemv_words_probe.py"])
def test_the_gemv_probes_kernels_compute_as_torch(probe: str) -> None:
    """The GPU probes' own kernels (tensor-core GEMVs over bf16, int8 and
    int4 rows; a bf16 GEMV widening by element and as words) against float64
    torch in Triton's interpreter: a probe that drifted from its kernels, or
    from gemv_probe's helpers it imports, fails here, not on a lent GPU."""
    path = Path(__file__).resolve().parents[2] / "bench" / probe
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(path), "--check"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
