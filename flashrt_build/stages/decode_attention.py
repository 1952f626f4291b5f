"""The `decode_attention` pass: a one-token step's attention as a Triton
split-KV kernel the package carries, reading the KV cache as it is.

For a decode step transformers' SDPA attention copies each layer's whole
cache once per query head it serves (`repeat_kv`), turns the boolean mask
into a float bias, and runs cuDNN's attention over every position of the
static cache, filled or not: six kernels a layer. This kernel reads each KV
head once for all the query heads of its group, skips the blocks the mask
hides (the unfilled cache), and splits the positions over programs whose
partial softmaxes a second kernel merges (flash-decoding): two kernels a
layer (their times are in BENCHMARKS.md).

Like the `gemv` pass it applies only while exporting (the eager reference
that verifies the package keeps SDPA), only on CUDA, only to a query of one
concrete token in bf16 or fp16 with a boolean mask (or none); every other
call (prefill, dropout, sinks, a float mask) keeps the attention it had.

After export `share_masks` gives the calls whose masks are the same view of
one tensor (each layer slices the model's one mask) one mask that Inductor
computes once, instead of once a layer.

`one_kernel_attention` (`give_counts`): each attention layer gets a count
per (batch, KV head) pair, a buffer its calls pass the kernel: each pair's
last split program then merges, and no merge kernel runs after it. The
counts are state the package writes in place; every call leaves them zero.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import fx, nn

from .attention import NAME as GROUPED
from .attention import grouped_sdpa, model_configs, register_attention
from .exporting import is_exporting
from .graph_match import calls, calls_op, computed_once, drop_unused
from .pdl import pdl_kernels

aten = torch.ops.aten

NAME = "flashrt_decode_sdpa"  # falls back to transformers' SDPA
GROUPED_NAME = "flashrt_decode_grouped_sdpa"  # falls back to the grouped_attention pass's
BLOCK_L = 64  # cache positions a loop step reads
PROGRAMS = 128  # programs a call aims at (about one wave of an H100's 132 SMs): sets the split
HALVES = (torch.bfloat16, torch.float16)
COUNTS = "flashrt_attention_counts"  # an attention layer's buffer under one_kernel_attention
PAIRS = 1024  # the (batch, KV head) pairs a call of it may have; past them the call takes two kernels


def split_of(pairs: int, length: int) -> tuple[int, int]:
    """(splits, chunk): the cache's positions cut into chunks of whole
    blocks, as many as bring the programs near PROGRAMS."""
    blocks = -(-length // BLOCK_L)
    splits = max(1, min(blocks, PROGRAMS // max(pairs, 1)))
    chunk = -(-blocks // splits) * BLOCK_L
    return -(-length // chunk), chunk


OPS = ("flashrt::decode_attention", "flashrt::decode_attention_merged")  # two kernels; one, with counts


@functools.cache
def decode_attention_op() -> Any:
    """`attend(query, key, value, mask, scale, cos=None, sin=None,
    counts=None)`: query (batch, heads, 1, dim); key and value (batch,
    kv_heads, length, dim); mask None or boolean (batch or 1, length); out
    (batch, 1, heads, dim). With cos and sin (batch or 1, 1, 1, dim) the
    query is rotated first: q * cos + rotate_half(q) * sin.

    Without `counts`, `flashrt::decode_attention`: a split kernel and a
    merge kernel. With them (int32 zeros, batch * kv_heads at least, left
    zero after each call), `flashrt::decode_attention_merged`, one kernel:
    each pair's last program merges its chunks (triton_kernels.merge_if_last).
    Two operators, not one with optional counts: torch 2.11 bumps the version
    of each mutated argument by its position, past the end of a call that
    leaves the defaults out (an IndexError that failed every export)."""
    from torch.library import triton_op

    @triton_op(OPS[0], mutates_args=())
    def decode_attention(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float,
        cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        return _attend(query, key, value, mask, scale, cos, sin, None)

    @triton_op(OPS[1], mutates_args=("counts",))
    def decode_attention_merged(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float,
        cos: torch.Tensor | None, sin: torch.Tensor | None, counts: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        return _attend(query, key, value, mask, scale, cos, sin, counts)

    def attend(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float,
        cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, counts: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        if counts is None:
            return torch.ops.flashrt.decode_attention.default(query, key, value, mask, scale, cos, sin)
        return torch.ops.flashrt.decode_attention_merged.default(query, key, value, mask, scale, cos, sin, counts)

    return attend


def _attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float,
    cos: torch.Tensor | None, sin: torch.Tensor | None, counts: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    """Both operators' body: the split kernel, merging where `counts` is given, else the merge kernel after it."""
    import triton
    from torch.library import wrap_triton

    from .triton_kernels import flashrt_pdl_attention_merge, flashrt_pdl_attention_split

    batch, heads, _, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    g_pad, d_pad = max(16, triton.next_power_of_2(groups)), max(16, triton.next_power_of_2(dim))
    splits, chunk = split_of(batch * kv_heads, length)
    part = query.new_empty((batch * kv_heads * splits, g_pad, d_pad), dtype=torch.float32)
    stats = query.new_empty((batch * kv_heads * splits, 2, g_pad), dtype=torch.float32)
    out = query.new_empty((batch, 1, heads, dim))
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    rotary = cos is not None and sin is not None
    cos, sin = (query if t is None else t if t.stride(-1) == 1 else t.contiguous() for t in (cos, sin))
    shape = dict(KV_HEADS=kv_heads, GROUPS=groups, G_PAD=g_pad, D=dim, D_PAD=d_pad, SPLITS=splits,
                 S_PAD=triton.next_power_of_2(splits), PDL=pdl_kernels(query))  # fmt: skip
    wrap_triton(flashrt_pdl_attention_split)[(batch * kv_heads, splits)](
        query, key, value, key if mask is None else mask, cos, sin, part, stats,
        stats if counts is None else counts, out, length, scale,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        0 if mask is None or mask.shape[0] == 1 else mask.stride(0), 0 if mask is None else mask.stride(1),
        0 if cos.shape[0] == 1 else cos.stride(0), 0 if sin.shape[0] == 1 else sin.stride(0),
        out.stride(0), out.stride(2), CHUNK=chunk, BLOCK_L=BLOCK_L, HAS_MASK=mask is not None, ROTARY=rotary,
        MERGE=counts is not None, num_warps=4, **shape,
    )  # fmt: skip
    if counts is None:
        merge = wrap_triton(flashrt_pdl_attention_merge)[(batch * heads,)]
        merge(part, stats, out, out.stride(0), out.stride(2), **shape)
    return out


# Ops whose result is a view of their input: the same chain of them over the same node is the same tensor
# wherever it stands in the graph (an in-place write between two such chains shows through both alike).
VIEWS = (aten.select.int, aten.slice.Tensor, aten.expand.default, aten.view.default, aten.unsqueeze.default,
         aten.alias.default)  # fmt: skip


def share_masks(program: torch.export.ExportedProgram) -> int:
    """Give the decode_attention calls whose masks are the same view of the
    same tensor one mask, computed once; how many calls took an earlier
    call's.

    Every layer takes the model's one mask (`mask[:, 0, 0, :length]`), and
    Inductor computes a cheap value an operator takes once for each taker: a
    kernel a layer writing the same bits (`position <= step`) before its
    attention, even where the calls take one graph node (graph_match.computed_once)."""
    graph = program.graph
    takers: dict[fx.Node, list[fx.Node]] = {}  # each distinct mask: the calls taking it
    for node in graph.nodes:
        if not calls_op(node, *OPS) or not isinstance(mask := node.args[3], fx.Node):
            continue
        same = next((m for m in takers if _same_view(m, mask)), mask)
        takers.setdefault(same, []).append(node)
    shared = 0
    for mask, calls_of in takers.items():
        if len(calls_of) < 2 or calls(mask, aten.as_strided.default) or (once := computed_once(graph, mask)) is None:
            continue
        for node in calls_of:
            node.args = (*node.args[:3], once, *node.args[4:])
        shared += len(calls_of) - 1
    if shared:
        drop_unused(graph)
        program.graph_module.recompile()
    return shared


def _same_view(a: Any, b: Any) -> bool:
    """`a` and `b` are one node, or the same chain of VIEWS over one node."""
    if a is b:
        return True
    if not (calls(a, *VIEWS) and calls(b, *VIEWS)) or a.target != b.target or a.kwargs != b.kwargs:
        return False
    if len(a.args) != len(b.args):
        return False
    return all(_same_view(x, y) if isinstance(x, fx.Node) else x == y for x, y in zip(a.args, b.args, strict=True))


def one_token_mask(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor | None | bool:
    """The mask as the kernel takes it, (batch or 1, length) boolean, None
    for no mask; False where the call is not the kernel's to run."""
    if mask is None:
        return None
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1:
        return False
    if mask.shape[0] not in (1, query.shape[0]) or mask.shape[3] < key.shape[2]:
        return False
    return mask[:, 0, 0, : key.shape[2]]


def _decode_sdpa(
    fallback: Any,
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: (batch, heads, length, dim) in,
    (batch, length, heads, dim) out; `fallback` where the kernel does not apply."""
    batch, heads, length, dim = query.shape
    # A symbolic length (prefill's dynamic prompt) is never compared: that would guard on it
    one_token = type(length) is int and length == 1
    mask = one_token_mask(query, key, attention_mask) if one_token else False
    runs = (
        is_exporting() and one_token and mask is not False
        and query.dtype in HALVES and key.dtype == value.dtype == query.dtype
        and key.shape[-1] == value.shape[-1] == dim and heads % key.shape[1] == 0
        and not dropout and kwargs.get("s_aux") is None and not kwargs.get("softcap")
    )  # fmt: skip
    if not runs:
        return fallback(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    assert mask is not False
    scale = dim**-0.5 if scaling is None else float(scaling)
    counts = getattr(module, COUNTS, None)  # one_kernel_attention's
    if counts is None or batch * key.shape[1] > counts.numel():
        return decode_attention_op()(query, key, value, mask, scale), None
    return decode_attention_op()(query, key, value, mask, scale, None, None, counts), None


def register() -> None:
    """Register the kernel's attention functions with transformers, by
    NAME (SDPA's fallback) and GROUPED_NAME (the grouped_attention pass's)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    register_attention(NAME, functools.partial(_decode_sdpa, sdpa_attention_forward))
    register_attention(GROUPED_NAME, functools.partial(_decode_sdpa, grouped_sdpa))


def use_decode_attention(module: nn.Module) -> int:
    """Switch every transformers model in `module` that runs SDPA (or the
    grouped_attention pass's) on a CUDA device to the kernel for its
    one-token calls; how many configs were switched."""
    chosen = [c for c in model_configs(module) if getattr(c, "_attn_implementation", None) in ("sdpa", GROUPED)]
    if not chosen or not any(p.is_cuda for p in module.parameters()):
        return 0
    register()
    for config in chosen:
        config._attn_implementation = NAME if config._attn_implementation == "sdpa" else GROUPED_NAME
    return len(chosen)


def give_counts(module: nn.Module) -> int:
    """Give each attention layer of the models `use_decode_attention`
    switched its counts (zeros: PAIRS int32), so its one-token calls run as
    one kernel; how many layers. An attention layer is a transformers
    `...Attention` module with its model's config and a `layer_idx`."""
    switched = [c for c in model_configs(module) if getattr(c, "_attn_implementation", None) in (NAME, GROUPED_NAME)]
    layers = 0
    for layer in module.modules():
        config = getattr(layer, "config", None)
        if (
            any(config is c for c in switched)
            and hasattr(layer, "layer_idx")
            and type(layer).__name__.endswith("Attention")
        ):
            device = next(layer.parameters()).device
            layer.register_buffer(COUNTS, torch.zeros(PAIRS, dtype=torch.int32, device=device), persistent=False)
            layers += 1
    return layers
