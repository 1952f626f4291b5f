"""The `rotary_fusion` pass (on in `passes=llm`): the query's rotary embedding
taken into the decode attention kernel, rewritten in the exported graph.
The kernel's rotation itself is checked against float64 in
test_decode_attention.py; here the rewrite of real decode graphs: every
layer's query rotary gone from the graph, k's kept, and the rewritten
program (run in Triton's interpreter) gives the logits the program without
the rewrite gives.

A CPU target takes no decode attention (`use_decode_attention` switches
CUDA models only), so the tests switch the tiny models to it by hand."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from fresh_process import in_fresh_process
from test_gemv_fusion import decode_module

from flashrt_build.stages import decode_attention
from flashrt_build.stages.attention import model_configs
from flashrt_build.stages.domain import preserved_buffers
from flashrt_build.stages.export import export_stage
from flashrt_build.stages.inputs import make_inputs
from flashrt_build.stages.rotary_fusion import fuse_rotary

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from llm_families import save_family  # noqa: E402


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("rotary_fusion")


def decode_graph(model_dir: Path, root: Path, rotary: bool = True, *more: str) -> tuple[Any, Any, Any]:
    """(plan, module, export stage) of an fp16 decode step with the llm passes (rotary_fusion on or off, and
    `more`), its layers given the GEMV and its models the decode attention (and with one_kernel_attention its
    layers their counts) as a CUDA build's are."""
    rotary_fusion = f"passes.rotary_fusion={str(rotary).lower()}"
    plan, module = decode_module(model_dir, root, "target.dtype=float16", rotary_fusion, *more)
    decode_attention.register()
    for config in model_configs(module):
        config._attn_implementation = decode_attention.NAME  # as use_decode_attention switches a CUDA model
    if plan.spec.one_kernel_attention:
        decode_attention.give_counts(module)  # as the pass gives a CUDA model's attention layers theirs
    return plan, module, export_stage(module, plan.spec)


def called(program: torch.export.ExportedProgram, target: str) -> list[torch.fx.Node]:
    return [n for n in program.graph.nodes if n.op == "call_function" and str(n.target) == target]


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma"])
def test_each_layers_query_rotary_moves_into_its_attention_kernel_and_the_logits_stay(
    families: Path, family: str
) -> None:
    model_dir = save_family(family, families / family)
    plan, module, stage = decode_graph(model_dir, families)
    _, _, plain = decode_graph(model_dir, families, rotary=False)
    program, before = stage.value[0].program, plain.value[0].program
    assert stage.sections["rewrites"]["rotary_fusion"] == {"methods": {"decode": {"queries": 2}}}
    assert "decode: 2 queries rotated in the attention kernel" in stage.note
    # the second layer's attention takes the first's mask (decode_attention.share_masks): both programs
    assert stage.sections["rewrites"]["decode_attention"] == {"methods": {"decode": {"masks_shared": 1}}}
    assert len({node.args[3] for node in called(program, "flashrt.decode_attention.default")}) == 1
    attention = called(program, "flashrt.decode_attention.default")
    assert len(attention) == 2 and all(len(node.args) == 7 for node in attention)
    assert all(len(node.args) == 5 for node in called(before, "flashrt.decode_attention.default"))
    # rotate_half negates half of q and half of k a layer: k's stays (it feeds the cache write)
    assert len(called(before, "aten.neg.default")) == 4 and len(called(program, "aten.neg.default")) == 2
    example = make_inputs(plan.spec, method=plan.spec.methods[0])
    saved = {name: families / f"{family}_{name}.pt2" for name in ("fused", "plain")}
    torch.export.save(program, saved["fused"])
    torch.export.save(before, saved["plain"])
    with preserved_buffers(module), torch.no_grad():  # both programs and eager run from the same cache
        eager = module.decode(*example.args, **example.kwargs)  # SDPA: the kernel runs only in the graph
        torch.save({"args": example.args, "kwargs": example.kwargs, "eager": eager}, families / f"{family}.io")
    in_fresh_process(
        textwrap.dedent(
            f"""
            import torch
            from flashrt_build.stages.decode_attention import decode_attention_op
            from flashrt_build.stages.gemv import gemv_fused_op, gemv_op
            gemv_op(), gemv_fused_op(), decode_attention_op()  # registered: the saved graphs call them by name
            io = torch.load({str(families / f"{family}.io")!r})
            with torch.no_grad():
                got, plain = (torch.export.load(path).module()(*io["args"], **io["kwargs"]).float()
                              for path in ({str(saved["fused"])!r}, {str(saved["plain"])!r}))
            assert got.shape == plain.shape, (got.shape, plain.shape)
            err = ((got - plain).abs().max() / plain.abs().max()).item()
            assert err < 1e-2, err  # fp16, the kernel's sums fp32
            eager = io["eager"].float()  # the graph without rotary_fusion (its mask computed once) against eager
            err = ((plain - eager).abs().max() / eager.abs().max()).item()
            assert err < 1e-2, err
            print("ok")
            """
        )
    )


class NearMisses(torch.nn.Module):
    """Queries beside what the pass must and must not take in: a rotary
    written with the halves swapped, one rotating with another tensor's
    halves, one whose tables are per head."""

    def forward(self, q: torch.Tensor, other: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                per_head: torch.Tensor) -> tuple[torch.Tensor, ...]:  # fmt: skip
        def attend(query: torch.Tensor) -> torch.Tensor:
            k = torch.ones(1, 2, 8, 16, dtype=query.dtype)
            return decode_attention.decode_attention_op()(query, k, k, None, 0.25)

        def half(x: torch.Tensor) -> torch.Tensor:
            return torch.cat((-x[..., 8:], x[..., :8]), dim=-1)

        whole = attend(q * cos + half(q) * sin)  # fused
        swapped = attend(q * cos + torch.cat((-q[..., :8], q[..., 8:]), dim=-1) * sin)  # not rotate_half: left
        mixed = attend(q * cos + half(other) * sin)  # another tensor's halves: left
        heads = attend(q * per_head + half(q) * per_head)  # tables per head: left
        return whole, swapped, mixed, heads


def test_only_the_whole_rotary_of_the_query_itself_is_taken_in() -> None:
    q, other = (torch.randn(1, 4, 1, 16, dtype=torch.bfloat16) for _ in range(2))
    cos, sin = (torch.randn(1, 1, 1, 16, dtype=torch.bfloat16) for _ in range(2))
    per_head = torch.randn(1, 4, 1, 16, dtype=torch.bfloat16)
    program = torch.export.export(NearMisses(), (q, other, cos, sin, per_head))
    assert fuse_rotary(program) == 1
    rotated = [n for n in called(program, "flashrt.decode_attention.default") if len(n.args) == 7]
    assert len(rotated) == 1 and rotated[0].args[0].name == "q"
    assert [n.args[5].name for n in rotated] == ["cos"] and [n.args[6].name for n in rotated] == ["sin"]
