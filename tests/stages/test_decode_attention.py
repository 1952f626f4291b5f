"""The `decode_attention` pass (`passes.decode_attention=true`): the Triton
split-KV kernel's attention equals SDPA's over a grouped cache under a mask
(run in Triton's interpreter here; compiled on a GPU), a CUDA decode graph
calls it once a layer while prefill keeps SDPA, and a CPU target switches
no model."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
import torch
from fresh_process import in_fresh_process
from test_passes import exported_after_passes, llama, llm_overrides  # noqa: F401  (llama: the fixture)

from flashrt_build.stages.custom_ops import triton_calls
from flashrt_build.stages.decode_attention import (
    BLOCK_L,
    OPS,
    PROGRAMS,
    decode_attention_op,
    one_token_mask,
    share_masks,
    split_of,
)


def attends_as_sdpa(device: str) -> None:
    """The kernel against SDPA on `device` (a CPU: Triton's interpreter), in a fresh process.
    Grouped heads (4 and 1 query heads a KV head, and 6), a cache of
    partial blocks, a mask shared by the batch and one per sequence with
    holes, no mask, one position seen (every other block skipped), head
    widths short of a power of two; each with the query as given and
    rotated by the kernel (rotary tables of a row per sequence, or one for
    the batch): within a bf16/fp16 output rounding of float64 SDPA over the
    cache repeated per head (an output rounding: the sums are fp32), the
    query rotated in float64 (the kernel keeps it in fp32: on a GPU its
    scores then take TF32 three times, one TF32 product being exact only
    for a bf16 or fp16 query). Each also as one kernel (`counts`: each
    pair's last program merges), one count array for every call: left at
    zero by each, as the next needs it."""
    script = textwrap.dedent(
        f"""
        import torch
        from flashrt_build.stages.decode_attention import decode_attention_op
        torch.manual_seed(0)
        torch.set_default_device({device!r})
        counts = torch.zeros(64, dtype=torch.int32)
        for batch, heads, kv, length, dim, seen, dtype, masks in [
                (1, 8, 2, 300, 64, 130, torch.bfloat16, 1), (2, 6, 6, 64, 40, 64, torch.float16, 2),
                (1, 4, 1, 1000, 32, 999, torch.bfloat16, 0), (2, 4, 2, 129, 16, 1, torch.bfloat16, 1)]:
            q = torch.randn(batch, 1, heads, dim, dtype=dtype).transpose(1, 2)  # strided, as a model hands it
            k, v = (torch.randn(batch, kv, length, dim, dtype=dtype) * 2 for _ in range(2))
            mask = None
            if masks:
                mask = torch.zeros(masks, 1, 1, length + 7, dtype=torch.bool)  # wider than the cache, as transformers'
                mask[..., :seen] = True
                if masks == 2:
                    mask[1, ..., 3:5] = False
            angles = torch.rand(batch if masks == 2 else 1, 1, 1, dim, dtype=torch.float64) * 6.3
            cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
            for rotary, merged in ((False, False), (True, False), (False, True), (True, True)):
                given = None if mask is None else mask[:, 0, 0, :length]
                tables = (cos, sin) if rotary else (None, None)
                out = decode_attention_op()(q, k, v, given, dim ** -0.5, *tables, counts if merged else None)
                assert not counts.any(), counts
                q64 = q.double()
                if rotary:
                    half = torch.cat((-q64[..., dim // 2:], q64[..., : dim // 2]), -1)
                    q64 = q64 * cos.double() + half * sin.double()
                g = heads // kv
                exact = torch.nn.functional.scaled_dot_product_attention(
                    q64, k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1),
                    attn_mask=None if mask is None else mask[..., :length]).transpose(1, 2)
                assert out.shape == (batch, 1, heads, dim) and out.dtype == dtype, (out.shape, out.dtype)
                err = ((out.double() - exact).abs() / exact.abs().clamp(min=1.0)).max().item()
                ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
                assert err <= ulp, (batch, heads, kv, length, rotary, merged, err)
        print("ok")
        """
    )
    in_fresh_process(script, device)


def test_the_kernel_attends_as_sdpa_does_in_the_triton_interpreter() -> None:
    attends_as_sdpa("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_compiled_kernel_attends_as_sdpa_does() -> None:
    """The same on a GPU: Triton compiled, its dots in TF32."""
    attends_as_sdpa("cuda")


def test_no_operator_mutates_an_argument_a_call_may_leave_out() -> None:
    """torch 2.11 (the GPU image's) bumps each mutated argument's version by
    its position: one a call leaves out (an optional's default) indexes past
    the call's arguments, and every two-kernel decode step failed to export
    so. The counts are the merging operator's own, and required."""
    decode_attention_op()
    plain, merged = (getattr(torch.ops.flashrt, name.split("::")[1]).default._schema for name in OPS)
    assert not [a for a in plain.arguments if a.alias_info is not None and a.alias_info.is_write]
    (written,) = [a for a in merged.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert written.name == "counts" and not written.has_default_value()
    assert not isinstance(written.type, torch.OptionalType)


@pytest.mark.parametrize(("pairs", "length"), [(8, 1024), (1, 300), (8, 64), (256, 4096), (2, 1)])
def test_the_split_covers_the_cache_in_whole_blocks_near_the_programs_aimed_at(pairs: int, length: int) -> None:
    splits, chunk = split_of(pairs, length)
    assert chunk % BLOCK_L == 0 and (splits - 1) * chunk < length <= splits * chunk  # every position, no empty chunk
    assert pairs * splits <= max(PROGRAMS, pairs)
    if pairs * splits * 2 <= PROGRAMS:  # fewer programs than aimed at only where the blocks ran out
        assert chunk == BLOCK_L


def test_only_a_boolean_one_token_mask_that_covers_the_cache_is_the_kernels() -> None:
    q, k = torch.zeros(2, 4, 1, 8), torch.zeros(2, 2, 16, 8)
    mask = torch.ones(2, 1, 1, 20, dtype=torch.bool)
    taken = one_token_mask(q, k, mask)
    assert isinstance(taken, torch.Tensor) and taken.shape == (2, 16)
    assert one_token_mask(q, k, None) is None
    assert one_token_mask(q, k, mask.float()) is False  # a float bias
    assert one_token_mask(q, k, mask.expand(2, 4, 1, 20)) is False  # per head
    assert one_token_mask(q, k, mask[..., :8]) is False  # short of the cache


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("grouped", [False, True])
def test_a_cuda_decode_graph_calls_the_kernel_once_a_layer_and_prefill_never(
    llama: tuple[Path, Path],  # noqa: F811
    grouped: bool,
) -> None:
    """Over SDPA and over the grouped_attention pass alike (prefill falls back to either)."""
    model_dir, root = llama
    more = ["passes.grouped_attention=true"] if grouped else []
    _, exported = exported_after_passes(model_dir, root, "target=cuda", "passes.decode_attention=true", *more)
    calls = {e.method.name: triton_calls(e.program).get("flashrt::decode_attention", 0) for e in exported}
    assert calls == {"prefill": 0, "decode": 2}


class Masks(torch.nn.Module):
    """Attention calls whose masks are, and are not, one view of one tensor:
    the same slice twice, another slice, the same computed (not viewed) mask twice."""

    def forward(self, q: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        k = torch.ones(1, 2, 8, 16, dtype=q.dtype)

        def attend(m: torch.Tensor) -> torch.Tensor:
            return decode_attention_op()(q, k, k, m, 0.25)

        first, again = attend(mask[:, 0, 0, :8]), attend(mask[:, 0, 0, :8])  # the second takes the first's
        shifted = attend(mask[:, 0, 0, 1:9])  # another view: its own
        inverted = [attend((~mask)[:, 0, 0, :8]) for _ in range(2)]  # computed each time: left as they are
        return first, again, shifted, *inverted


def test_attention_calls_share_a_mask_only_where_it_is_the_same_view_of_one_tensor() -> None:
    q, mask = torch.randn(1, 4, 1, 16, dtype=torch.bfloat16), torch.ones(1, 1, 1, 10, dtype=torch.bool)
    program = torch.export.export(Masks(), (q, mask))
    assert share_masks(program) == 1
    calls = [n for n in program.graph.nodes if str(n.target) == "flashrt.decode_attention.default"]
    masks = [n.args[3] for n in calls]
    assert masks[1] is masks[0] and len({id(m) for m in masks}) == 4
    # the shared one: an identity as_strided of the first call's slice (computed_once), the second's slice gone
    assert str(masks[0].target) == "aten.as_strided.default" and str(masks[0].args[0].target) == "aten.slice.Tensor"
    assert masks[0].meta["val"].shape == (1, 8) and masks[0].args[1:] == ([1, 8], [10, 1], 0)
    assert len([n for n in program.graph.nodes if str(n.target) == "aten.slice.Tensor"]) == 4
    assert share_masks(program) == 0  # nothing left to share


@torch.library.custom_op("flashrt_test::masked", mutates_args=())
def masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """An operator Inductor cannot inline (as the attention kernel): x where the mask holds."""
    return torch.where(mask, x, 0.0)


@masked.register_fake
def _(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class Layers(torch.nn.Module):
    """Four layers, each taking one step's mask (`position <= step`) as a view."""

    def forward(self, x: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        mask = (torch.arange(64) <= step).view(1, 1, 1, 64).expand(1, 1, 1, 64)
        for _ in range(4):
            x = masked(x, mask[:, 0, 0, :]) + 1
        return x


def launches_comparing(code: str) -> int:
    """How many kernel launches of Inductor's generated CPU code compute a `<=`."""
    kernels = re.findall(r"(\w+) = async_compile\.cpp_pybinding\((.*?)\'\'\'\)", code, re.DOTALL)
    comparing = [name for name, source in kernels if "<=" in source]
    return sum(len(re.findall(rf"\n\s+{name}\(", code)) for name in comparing)


@pytest.mark.slow
def test_a_value_computed_once_is_one_kernel_however_many_operators_take_it() -> None:
    """Why share_masks gives the calls an as_strided of the mask, not the
    mask node itself: Inductor (here for the CPU; the lowering is the GPU's)
    computes a cheap value once for each operator taking it, even one node."""
    from torch._inductor.utils import run_and_get_code

    from flashrt_build.stages.graph_match import computed_once

    x, step = torch.randn(1, 64), torch.tensor(5)
    programs = [torch.export.export(Layers(), (x, step)) for _ in range(2)]
    graph = programs[1].graph
    takers = [n for n in graph.nodes if n.target is torch.ops.flashrt_test.masked.default]
    once = computed_once(graph, takers[0].args[1])
    for node in takers:
        node.args = (node.args[0], once)
    programs[1].graph_module.recompile()
    kernels = []
    for program in programs:
        torch._dynamo.reset()
        got, (code, *_) = run_and_get_code(torch.compile(program.module()), x, step)
        assert torch.equal(got, Layers()(x, step))
        kernels.append(launches_comparing(code))
    assert kernels == [4, 1]


class OneKernel(torch.nn.Module):
    """Two attention calls (two layers) as one kernel each, their counts a buffer of the module's."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("counts", torch.zeros(8, dtype=torch.int32))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        first = decode_attention_op()(q, k, v, None, 0.125, None, None, self.counts)
        return decode_attention_op()(first.transpose(1, 2), k, v, None, 0.125, None, None, self.counts)


def test_the_one_kernel_attentions_counts_are_state_the_exported_program_writes_and_leaves_zero(
    tmp_path: Path,
) -> None:
    """Exported, the counts are a buffer the program mutates (a package's state, written in place), and
    the program run in Triton's interpreter leaves them zero after each call, its output the module's."""
    args = (torch.randn(1, 4, 1, 16).bfloat16(), *(torch.randn(1, 2, 200, 16).bfloat16() for _ in range(2)))
    program = torch.export.export(OneKernel(), args)
    functional = program.run_decompositions({})  # as the export stage reads a program's state, and Inductor takes it
    assert list(functional.graph_signature.buffers_to_mutate.values()) == ["counts"]
    torch.export.save(program, tmp_path / "one.pt2")
    torch.save(args, tmp_path / "one.args")
    script = textwrap.dedent(
        f"""
        import torch
        from flashrt_build.stages.decode_attention import decode_attention_op
        decode_attention_op()  # registered: the saved graph calls it by name
        program = torch.export.load({str(tmp_path / "one.pt2")!r})
        args = torch.load({str(tmp_path / "one.args")!r})
        module = program.module()
        for _ in range(2):
            got = module(*args)
            assert not module.counts.any(), module.counts
        first = decode_attention_op()(*args, None, 0.125)  # two kernels: split, merge
        expected = decode_attention_op()(first.transpose(1, 2), *args[1:], None, 0.125)
        assert torch.allclose(got.float(), expected.float(), atol=1e-2), (got.float() - expected.float()).abs().max()
        print("ok")
        """
    )
    in_fresh_process(script)
