"""The `grouped_attention` pass: grouped-query attention without copying the
KV cache per query head.

transformers' SDPA attention copies the keys and values of every KV head
once per query head it serves (`repeat_kv`) whenever there is a mask: torch's
fused kernels take grouped heads only without one. A decode step with a
static cache always has one, so each layer copies its whole cache every
step (on an H100, 0.12 ms of a 1.6 ms Llama-3.2-1B step). Folding each
group's query heads into the query's length instead (the rows of a group
attend to the same keys under the same mask) gives SDPA the cache as it is.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

NAME = "flashrt_grouped_sdpa"


def grouped_sdpa(
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
    (batch, length, heads, dim) out; its SDPA where folding does not apply."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    mask = attention_mask
    # SDPA's own path where folding does not apply: no grouping, dropout, a
    # float or per-head mask, attention sinks, heads of other widths.
    plain = mask is None or mask.dim() != 4 or mask.shape[1] != 1 or mask.dtype != torch.bool
    widths = {key.shape[-1], value.shape[-1]} != {dim}
    # On CUDA a folded query of symbolic length (prefill's dynamic prompt)
    # makes SDPA's mask padding guard on the prompt, which export refuses
    # (torch 2.11, H100); the decode step it is for has a concrete length.
    symbolic = query.is_cuda and not isinstance(length, int)
    if heads == kv_heads or dropout or plain or kwargs.get("s_aux") is not None or widths or symbolic:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    assert mask is not None
    groups = heads // kv_heads
    # Head h attends with KV head h // groups: a group's heads are adjacent, so
    # (batch, kv_heads, groups * length, dim) puts them on one KV head's rows.
    folded = query.reshape(batch, kv_heads, groups * length, dim)
    mask = mask[:, :, :, : key.shape[-2]].expand(-1, -1, length, -1).repeat(1, 1, groups, 1)
    out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, length, dim).transpose(1, 2).contiguous(), None


def model_configs(module: nn.Module) -> list[Any]:
    """The transformers configs of the models in `module`, each once."""
    return list({id(c): c for m in module.modules() if (c := getattr(m, "config", None)) is not None}.values())


def register_attention(name: str, attention: Any) -> None:
    """Register `attention` with transformers under `name`, taking the boolean masks SDPA takes."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, sdpa_mask)


def group_attention(module: nn.Module) -> int:
    """Switch every transformers model in `module` that runs SDPA over grouped
    KV heads to `grouped_sdpa`; how many configs were switched."""
    register_attention(NAME, grouped_sdpa)
    switched = 0
    for config in model_configs(module):
        heads, kv_heads = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
        if getattr(config, "_attn_implementation", None) == "sdpa" and kv_heads and heads and kv_heads < heads:
            config._attn_implementation = NAME
            switched += 1
    return switched
