"""The `gemv_fusion` pass (on in `passes=llm`): the fused GEMV kernel's
prologues and epilogue (run in Triton's interpreter here), and the rewrite
of an exported decode graph: every RMSNorm, SiLU gate and residual add
around a GEMV taken into its kernel, nothing else, and the rewritten
program's logits equal the eager module's.

A CPU target takes no GEMV (`use_gemv` gives its forward to CUDA layers
only), so the graph tests give the tiny models' linear layers that forward
by hand and run the rewritten program in the interpreter in a fresh process."""

from __future__ import annotations

import sys
import textwrap
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from fresh_process import in_fresh_process
from test_passes import llm_overrides

from flashrt_build.cache.plan import make_plan
from flashrt_build.config.compose import compose
from flashrt_build.stages.domain import preserved_buffers
from flashrt_build.stages.export import calling, export_stage
from flashrt_build.stages.gemv import GATED, gemv_forward, gemv_op
from flashrt_build.stages.gemv_fusion import fuse_gemv_neighbours
from flashrt_build.stages.graph_match import calls_op
from flashrt_build.stages.inputs import make_inputs
from flashrt_build.stages.module import instantiate_stage
from flashrt_build.stages.passes import passes_stage

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from llm_families import save_family  # noqa: E402


def computes_as_torch(device: str) -> None:
    """Each prologue (none, RMSNorm * v, SiLU(x) * v) with and without a
    bias and a residual, and SiLU(gate) * up out of one weight (glu), K past one block and short of one, an odd N, bf16
    and fp32, one and two weight tiles loaded ahead: within an output rounding of float64 torch (fp32: of its sums)."""
    in_fresh_process(
        textwrap.dedent(
            f"""
            import torch
            from flashrt_build.stages import gemv
            from flashrt_build.stages.gemv import GATED, NONE, NORM, gemv_fused_op
            torch.manual_seed(0)
            torch.set_default_device({device!r})
            silu = torch.nn.functional.silu
            for prefetch in (1, 2):  # the weight tiles loaded before the wait: as shipped, and two
                gemv.PREFETCH = prefetch
                for n, k, dtype in [(7, 40, torch.bfloat16), (33, 2100, torch.bfloat16), (5, 1024, torch.float32)]:
                    w, x, v = (torch.randn(shape, dtype=dtype) for shape in ((n, k), (1, 1, k), (k,)))
                    for prologue, bias, residual in [(NONE, True, True), (NORM, False, False), (NORM, True, True),
                                                     (GATED, False, True), (GATED, True, False)]:
                        b = torch.randn(n, dtype=dtype) if bias else None
                        r = torch.randn(1, 1, n, dtype=dtype) if residual else None
                        y = gemv_fused_op()(x, w, b, v if prologue else None, r, 1e-5, prologue)
                        x64 = x.double()
                        p = {{NONE: x64, NORM: x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * v.double(),
                             GATED: silu(x64) * v.double()}}[prologue]
                        exact = torch.nn.functional.linear(p, w.double(), None if b is None else b.double())
                        exact = exact + (0 if r is None else r.double())
                        assert y.shape == (1, 1, n) and y.dtype == dtype, (y.shape, y.dtype)
                        ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -16
                        err = ((y.double() - exact).abs() / exact.abs().clamp(min=1.0)).max().item()
                        assert err <= ulp, (prefetch, n, k, dtype, prologue, bias, residual, err)
                    # glu: gate's rows then up's in one weight, SiLU(gate) * up out (a norm before it, a bias,
                    # a residual)
                    w2, b2 = torch.randn(2 * n, k, dtype=dtype), torch.randn(2 * n, dtype=dtype)
                    for prologue, bias, residual in [(NORM, False, False), (NONE, True, True)]:
                        b = b2 if bias else None
                        r = torch.randn(1, 1, n, dtype=dtype) if residual else None
                        y = gemv_fused_op()(x, w2, b, v if prologue else None, r, 1e-5, prologue, True)
                        x64 = x.double()
                        norm = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)
                        p = x64 * norm * v.double() if prologue else x64
                        both = torch.nn.functional.linear(p, w2.double(), None if b is None else b.double())
                        gate, up = both.split(n, -1)
                        exact = silu(gate) * up + (0 if r is None else r.double())
                        assert y.shape == (1, 1, n) and y.dtype == dtype, (y.shape, y.dtype)
                        ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -15
                        err = ((y.double() - exact).abs() / exact.abs().clamp(min=1.0)).max().item()
                        assert err <= ulp, ("glu", prefetch, n, k, dtype, prologue, bias, residual, err)
            print("ok")
            """
        ),
        device,
    )


def test_the_fused_kernel_normalizes_gates_and_adds_as_torch_does_in_the_triton_interpreter() -> None:
    computes_as_torch("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_compiled_fused_kernel_normalizes_gates_and_adds_as_torch_does() -> None:
    computes_as_torch("cuda")


def decode_module(model_dir: Path, root: Path, *more: str) -> tuple[Any, torch.nn.Module]:
    """The plan of a decode step with the llm passes (and `more`), and its
    module after them, its linear layers given the GEMV as a CUDA build's are."""
    plan = make_plan(compose(llm_overrides(model_dir, root, "passes=llm", "~module.methods.prefill", *more)))
    module = instantiate_stage(plan.spec, plan.digests).value
    passes_stage(module, plan.spec)
    for layer in module.modules():
        if isinstance(layer, torch.nn.Linear):
            layer.forward = types.MethodType(gemv_forward, layer)  # as use_gemv gives a CUDA layer
    return plan, module


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gemv_fusion")


@pytest.mark.parametrize(
    ("family", "fused"),
    [
        # 2 layers: q/k/v and gate/up after a norm, the lm_head after the final one; o and down add the residual
        ("llama", {"norms": 5, "gates": 2, "residuals": 4}),
        ("qwen2", {"norms": 5, "gates": 2, "residuals": 4}),  # its q/k/v have biases: the fused GEMV adds them
        # Gemma's norm scales by 1 + w in fp32 (not transformers' Llama RMSNorm): left as it is
        ("gemma", {"norms": 0, "gates": 0, "residuals": 4}),
    ],
)
def test_the_decode_graph_takes_its_norms_gates_and_residual_adds_into_the_gemvs_and_gives_eager_logits(
    families: Path, family: str, fused: dict[str, int]
) -> None:
    plan, module = decode_module(save_family(family, families / family), families)
    stage = export_stage(module, plan.spec)
    program = stage.value[0].program
    assert stage.sections["rewrites"]["gemv_fusion"] == {"methods": {"decode": fused}}
    assert f"decode: fused into GEMVs {fused['norms']} norms, {fused['gates']} gates" in stage.note
    called = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    gemvs = called.count("flashrt.gemv.default") + called.count("flashrt.gemv_fused.default")
    assert gemvs == 2 * 4 + 1  # every GEMV kept, fused or not
    assert called.count("flashrt.gemv_fused.default") == (9 if fused["norms"] else 4)
    if fused["norms"]:  # nothing left of the norms or the gate outside the GEMVs
        assert not {"aten.rsqrt.default", "aten.silu.default"} & set(called)
    fused_calls = [n.args for n in program.graph.nodes if calls_op(n, "flashrt::gemv_fused")]
    # the fused gate/up GEMV returns SiLU(gate) * up itself: down reads it as it is, no program recomputes it
    assert sum(bool(args[7:] and args[7]) for args in fused_calls) == fused["gates"]
    assert not [args for args in fused_calls if args[6] == GATED]
    example = make_inputs(plan.spec, method=plan.spec.methods[0])
    with torch.no_grad(), preserved_buffers(module), calling(module, plan.spec.methods[0]):
        expected = module(*example.args, **example.kwargs)
    saved = families / f"{family}.pt2"
    torch.export.save(program, saved)
    torch.save({"args": example.args, "kwargs": example.kwargs, "expected": expected}, families / f"{family}.io")
    in_fresh_process(
        textwrap.dedent(
            f"""
            import torch
            from flashrt_build.stages.gemv import gemv_fused_op, gemv_op
            gemv_op(), gemv_fused_op()  # registered: the saved graph calls them by name
            program = torch.export.load({str(saved)!r})
            io = torch.load({str(families / f"{family}.io")!r})
            with torch.no_grad():
                got = program.module()(*io["args"], **io["kwargs"])
            expected = io["expected"]
            assert got.shape == expected.shape, (got.shape, expected.shape)
            err = ((got - expected).abs().max() / expected.abs().max()).item()
            assert err < 1e-5, err
            print("ok")
            """
        )
    )


class Neighbours(torch.nn.Module):
    """GEMVs beside what the pass must and must not take in: a norm whose
    output is used again, a gate written up * silu(gate), a residual added
    with alpha, one added by broadcasting, one in another dtype."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(8, 16, generator=g) / 4)
        self.down = torch.nn.Parameter(torch.randn(16, 8, generator=g) / 4)
        self.norm = torch.nn.Parameter(torch.randn(16, generator=g) + 1)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        def gemv(x: torch.Tensor, w: torch.Tensor, bias: None) -> torch.Tensor:  # the GEMV in the graph, eager: linear
            return gemv_op()(x, w, bias) if torch.compiler.is_exporting() else torch.nn.functional.linear(x, w)

        x = h.to(torch.float32)
        normed = self.norm * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)
        y = gemv(normed, self.w, None)  # norm: fused, though `normed` is returned too
        gate = gemv(normed, self.w, None)
        z = gemv(gate * torch.nn.functional.silu(y), self.down, None)  # gate, operands swapped: fused
        alpha = torch.add(gemv(h, self.w, None), y, alpha=2.0)  # alpha: left
        wide = gemv(h, self.w, None) + torch.ones(3, 1, 8)  # broadcast to another shape: left
        upcast = gemv(h, self.w, None) + y.double()  # promoted to float64: left
        return normed, z, alpha, wide, upcast


def test_only_whole_patterns_are_fused_and_the_program_still_computes_the_module(families: Path) -> None:
    h = torch.randn(1, 1, 16)
    program = torch.export.export(Neighbours(), (h,))
    counts = fuse_gemv_neighbours(program)
    assert dict(counts) == {"norms": 2, "gates": 1, "residuals": 0}
    called = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert called.count("flashrt.gemv_fused.default") == 3 and called.count("flashrt.gemv.default") == 3
    assert "aten.rsqrt.default" in called  # `normed` is an output: its norm stays for it
    with torch.no_grad():
        expected = Neighbours()(h)  # the eager module: gemv_op runs only in the graph
    saved = families / "neighbours.pt2"
    torch.export.save(program, saved)
    torch.save({"h": h, "expected": expected}, families / "neighbours.io")
    in_fresh_process(
        textwrap.dedent(
            f"""
            import torch
            from flashrt_build.stages.gemv import gemv_fused_op, gemv_op
            gemv_op(), gemv_fused_op()
            program = torch.export.load({str(saved)!r})
            io = torch.load({str(families / "neighbours.io")!r})
            got = program.module()(io["h"])
            for a, b in zip(got, io["expected"], strict=True):
                assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
                assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (a - b).abs().max()
            print("ok")
            """
        )
    )


class FinalNorm(torch.nn.Module):
    """One norm and its GEMV, nothing else to fuse: a quantized model's
    lm_head (its other layers keep their own kernels)."""

    def __init__(self) -> None:
        super().__init__()
        self.w, self.norm = torch.nn.Parameter(torch.randn(8, 16)), torch.nn.Parameter(torch.ones(16))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = h.to(torch.float32)
        normed = self.norm * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)
        return gemv_op()(normed, self.w, None)


def test_one_fused_gemv_is_counted_in_integers() -> None:
    """The manifest's counts are integers (its schema refused a quantized
    build's `norms: true`: a Counter's first update keeps the value as given)."""
    counts = fuse_gemv_neighbours(torch.export.export(FinalNorm(), (torch.randn(1, 1, 16),)))
    assert {what: (type(n), n) for what, n in counts.items()} == {"norms": (int, 1), "residuals": (int, 0)}
