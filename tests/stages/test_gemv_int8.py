"""The GEMV on int8 weights (`gemv` with `quant=int8_wo`): torchao's
weight-only int8 rows and their scales read as they are, the int8 bytes
converted in the kernel and each row's sum scaled (run in Triton's
interpreter here), and an int8 decode graph whose every quantized layer
calls it, its norms, gates and residual adds fused as a float graph's, the
program's logits those of the quantized eager module."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from fresh_process import in_fresh_process
from llm_families import save_family  # noqa: E402  (test_gemv_fusion put tests/ on the path)
from test_gemv_fusion import decode_module

from flashrt_build.stages.domain import preserved_buffers
from flashrt_build.stages.export import calling, export_stage
from flashrt_build.stages.graph_match import calls_op
from flashrt_build.stages.inputs import make_inputs
from flashrt_build.stages.quantize import quantize_stage


def computes_as_torch(device: str) -> None:
    """Each prologue with and without a bias and a residual, and glu (gate's
    and up's scales the rows' own), on int8 rows scaled as torchao scales
    them: within an output rounding of float64 torch over the same int8 values."""
    in_fresh_process(
        textwrap.dedent(
            f"""
            import torch
            from flashrt_build.stages.gemv import GATED, NONE, NORM, gemv_fused_op, gemv_op
            torch.manual_seed(0)
            torch.set_default_device({device!r})
            silu = torch.nn.functional.silu
            for n, k, dtype in [(7, 40, torch.bfloat16), (33, 2100, torch.bfloat16), (5, 1024, torch.float32)]:
                q, s = torch.randint(-127, 128, (2 * n, k), dtype=torch.int8), torch.rand(2 * n, 1) / 64
                x, v = torch.randn(1, 1, k, dtype=dtype), torch.randn(k, dtype=dtype)
                w64 = q.double() * s.double()  # the weights the int8 rows stand for
                ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -15
                def close(y, exact, *case):
                    assert y.shape == exact.shape and y.dtype == dtype, (y.shape, y.dtype)
                    err = ((y.double() - exact).abs() / exact.abs().clamp(min=1.0)).max().item()
                    assert err <= ulp, (n, k, dtype, *case, err)
                b = torch.randn(2 * n, dtype=dtype)
                exact = torch.nn.functional.linear(x.double(), w64[:n], b[:n].double())
                close(gemv_op()(x, q[:n], b[:n], s[:n]), exact)
                x64 = x.double()
                normed = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * v.double()
                for prologue, bias, residual in [(NORM, False, True), (GATED, True, False), (NONE, True, True)]:
                    r = torch.randn(1, 1, n, dtype=dtype) if residual else None
                    y = gemv_fused_op()(x, q[:n], b[:n] if bias else None, None if prologue == NONE else v, r,
                                        1e-5, prologue, False, s[:n])
                    p = {{NONE: x64, NORM: normed, GATED: silu(x64) * v.double()}}[prologue]
                    exact = torch.nn.functional.linear(p, w64[:n], b[:n].double() if bias else None)
                    close(y, exact + (0 if r is None else r.double()), prologue, bias, residual)
                y = gemv_fused_op()(x, q, b, v, None, 1e-5, NORM, True, s)  # glu: gate's rows, then up's
                gate, up = torch.nn.functional.linear(normed, w64, b.double()).split(n, -1)
                close(y, silu(gate) * up, "glu")
            print("ok")
            """
        ),
        device,
    )


GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU)])  # the interpreter; compiled
def test_the_kernel_reads_int8_rows_and_their_scales(device: str) -> None:
    computes_as_torch(device)


def test_an_int8_decode_graph_reads_its_int8_weights_in_gemvs_and_gives_the_quantized_modules_logits(
    tmp_path: Path,
) -> None:
    plan, module = decode_module(save_family("llama", tmp_path / "llama"), tmp_path, "quant=int8_wo")
    quantize_stage(module, plan.spec)
    stage = export_stage(module, plan.spec)
    program = stage.value[0].program
    # fused as the float graph is (test_gemv_fusion): the norms, gates and residual adds all in the GEMVs
    assert stage.sections["rewrites"]["gemv_fusion"] == {
        "methods": {"decode": {"norms": 5, "gates": 2, "residuals": 4}}
    }
    gemvs = [n for n in program.graph.nodes if calls_op(n, "flashrt::gemv") or calls_op(n, "flashrt::gemv_fused")]
    weights = [n.args[1].meta["val"].dtype for n in gemvs]
    assert len(gemvs) == 2 * 4 + 1 and weights.count(torch.int8) == 2 * 4  # the lm_head stays float (int8_wo's rule)
    for node in gemvs:  # an int8 weight's call carries its scales (its last argument), a float one's none
        at = 3 if calls_op(node, "flashrt::gemv") else 8
        scale, int8 = node.args[at] if len(node.args) > at else None, node.args[1].meta["val"].dtype == torch.int8
        assert (scale is not None) == int8, node.format_node()
        if int8:  # one fp32 scale a weight row
            assert scale.meta["val"].dtype == torch.float32
            assert scale.meta["val"].numel() == node.args[1].meta["val"].shape[0]
    called = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert not {"aten.mm.default", "aten.linear.default", "aten.addmm.default"} & called  # no matmul left over
    example = make_inputs(plan.spec, method=plan.spec.methods[0])
    with torch.no_grad(), preserved_buffers(module), calling(module, plan.spec.methods[0]):
        expected = module(*example.args, **example.kwargs)  # torchao's own int8 linear, eager
    torch.export.save(program, tmp_path / "int8.pt2")
    torch.save({"args": example.args, "kwargs": example.kwargs, "expected": expected}, tmp_path / "int8.io")
    in_fresh_process(
        textwrap.dedent(
            f"""
            import torch
            from flashrt_build.stages.gemv import gemv_fused_op, gemv_op
            gemv_op(), gemv_fused_op()  # registered: the saved graph calls them by name
            program = torch.export.load({str(tmp_path / "int8.pt2")!r})
            io = torch.load({str(tmp_path / "int8.io")!r})
            with torch.no_grad():
                got = program.module()(*io["args"], **io["kwargs"])
            err = ((got - io["expected"]).abs().max() / io["expected"].abs().max()).item()
            assert got.shape == io["expected"].shape and err < 1e-5, err
            print("ok")
            """
        )
    )
