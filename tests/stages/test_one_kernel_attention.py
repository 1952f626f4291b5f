"""The `one_kernel_attention` pass (`passes.one_kernel_attention=true`): each
attention layer of a decode step gets its count, a buffer its decode
attention call passes the kernel (one kernel a layer: each KV head's last
program merges), the counts are state the program writes, rotary_fusion
still takes each query's rotary in, and the program (run in Triton's
interpreter) gives the two-kernel program's logits and leaves every count
at zero. The kernel itself: test_decode_attention.py.

A CPU target takes no decode attention (`use_decode_attention` switches
CUDA models only), so the tests switch the tiny model to it by hand."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from fresh_process import in_fresh_process
from llm_families import save_family
from test_passes import llm_overrides
from test_rotary_fusion import called, decode_graph

from flashrt_build.cache.plan import make_plan
from flashrt_build.config.compose import compose
from flashrt_build.stages import decode_attention
from flashrt_build.stages.inputs import make_inputs
from flashrt_build.stages.module import instantiate_stage
from flashrt_build.stages.passes import passes_stage

COUNTS = [f"model.layers.{i}.self_attn.{decode_attention.COUNTS}" for i in range(2)]


@pytest.mark.parametrize("rotary", [False, True])
def test_each_layer_passes_its_counts_which_are_state_and_the_logits_stay(tmp_path: Path, rotary: bool) -> None:
    model_dir = save_family("llama", tmp_path / "llama")
    plan, module, stage = decode_graph(model_dir, tmp_path, rotary, "passes.one_kernel_attention=true")
    program, two_kernels = stage.value[0].program, decode_graph(model_dir, tmp_path, rotary)[2].value[0].program
    assert sorted(name for name, _ in module.named_buffers() if name.endswith(decode_attention.COUNTS)) == COUNTS
    calls = called(program, "flashrt.decode_attention_merged.default")
    assert len(calls) == 2 and len({n.args[7] for n in calls}) == 2  # each layer its own counts
    assert not called(program, "flashrt.decode_attention.default")  # the two-kernel operator: no call left
    assert len(called(two_kernels, "flashrt.decode_attention.default")) == 2
    assert all((n.args[5] is not None) == rotary for n in calls)  # rotary_fusion took the query's rotary in or not
    assert set(COUNTS) <= set(stage.value[0].state)  # written in place by the package, as its KV cache
    example = make_inputs(plan.spec, method=plan.spec.methods[0])
    torch.export.save(program, tmp_path / "one.pt2")
    torch.export.save(two_kernels, tmp_path / "two.pt2")
    torch.save({"args": example.args, "kwargs": example.kwargs}, tmp_path / "io.pt")
    in_fresh_process(
        textwrap.dedent(
            f"""
            import torch
            from flashrt_build.stages.decode_attention import decode_attention_op
            from flashrt_build.stages.gemv import gemv_fused_op, gemv_op
            gemv_op(), gemv_fused_op(), decode_attention_op()  # registered: the saved graphs call them by name
            io = torch.load({str(tmp_path / "io.pt")!r})
            one, two = (torch.export.load({str(tmp_path)!r} + name).module() for name in ("/one.pt2", "/two.pt2"))
            with torch.no_grad():
                for _ in range(2):  # the second call runs on the counts the first left
                    got, expected = (m(*io["args"], **io["kwargs"]).float() for m in (one, two))
                    err = ((got - expected).abs().max() / expected.abs().max()).item()
                    assert err < 1e-2, err  # fp16; the one kernel merges as the merge kernel does
                    counts = [b for name, b in one.named_buffers() if name.endswith({decode_attention.COUNTS!r})]
                    assert len(counts) == 2 and not any(c.any() for c in counts), counts
            print("ok")
            """
        )
    )


def test_on_a_cpu_target_it_gives_no_layer_its_counts_and_says_why(tmp_path: Path) -> None:
    model_dir = save_family("llama", tmp_path / "llama")
    plan = make_plan(compose(llm_overrides(model_dir, tmp_path, "passes=llm", "passes.one_kernel_attention=true")))
    module = instantiate_stage(plan.spec, plan.digests).value
    stage = passes_stage(module, plan.spec)
    assert not [name for name, _ in module.named_buffers() if name.endswith(decode_attention.COUNTS)]
    assert stage.sections["passes"]["one_kernel_attention"] == {"layers": 0}
    assert "one_kernel_attention: no decode attention to merge in (target.device=cpu)" in stage.note
