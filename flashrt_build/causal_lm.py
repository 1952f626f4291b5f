"""The `causal_lm` module: any transformers `*ForCausalLM`, from its
`save_pretrained` directory, as two entry points over a static KV cache:

    prefill(input_ids [batch, prompt])           -> logits [batch, prompt, vocab]   (the cache restarts)
    decode(input_ids [batch, 1], position [batch]) -> logits [batch, 1, vocab]      (the token at `position`)

what `flashrt_build.generate` calls. The cache is transformers' own
`StaticCache`; export functionalises in-place writes only into registered
buffers, so every tensor its layers hold (keys, values) is re-homed as a
buffer of this module and the layers are pointed back at the buffers at the
start of each call: the package's state, written in place, what prefill
writes decode reads. The 0-d count of cached tokens is not state: each call
sets it before anything reads it, so it is the call's own tensor (as a
buffer, every layer's `add_` to it was a write the package had to make: a
kernel a layer in a decode step). The module's parameters keep the model's
own names (its children are the model's), so a package binds a directory of
the same model's weights at load (`load(out, weights=DIR)`).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch
from torch import nn

COUNT = "cumulative_length"  # a cache layer's count of cached tokens


class CausalLM(nn.Module):
    """A transformers causal LM loaded from `pretrained` (a save_pretrained
    directory), with a static KV cache of `max_cache_len` positions for
    `batch` sequences; the directory's own code (`auto_map`) runs only if
    `trust_remote_code`."""

    # Held outside the module tree (object.__setattr__): transformers objects.
    _model: Any
    _cache: Any

    def __init__(self, pretrained: str, max_cache_len: int, batch: int = 1, trust_remote_code: bool = False) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        from .runtime.checkpoint import FROM_PRETRAINED, check_loading_report, loading_pretrained

        # transformers' own loading: shards or .bin, tied weights, the per-expert
        # layout a mixture-of-experts checkpoint keeps; what it could not load fails
        with loading_pretrained("module.pretrained", pretrained):
            model, report = AutoModelForCausalLM.from_pretrained(
                Path(pretrained), local_files_only=True, **{**FROM_PRETRAINED, "trust_remote_code": trust_remote_code}
            )
        check_loading_report(report, "module.pretrained", pretrained)
        if getattr(model, "_can_set_experts_implementation", lambda: False)():
            # The default experts path traces into transformers::grouped_mm_fallback, a
            # Python-only custom op a package cannot run; batched_mm is plain aten.
            model.set_experts_implementation("batched_mm")
        model.eval()
        for name, child in model.named_children():  # the model's own names, not model.*
            self.add_module(name, child)
        for name, tensor in model.named_parameters(recurse=False):
            self.register_parameter(name, tensor)
        object.__setattr__(self, "_model", model)  # not a submodule: its modules are this module's
        self.batch, self.max_cache_len = batch, max_cache_len
        # transformers 5 names the cache `cache` (`past_key_values` is deprecated); older ones, only the latter
        takes = inspect.signature(model.forward).parameters
        self._cache_argument = "cache" if "cache" in takes else "past_key_values"
        self._rehome_plain_tensors()
        try:
            object.__setattr__(self, "_cache", _static_cache(model, batch, max_cache_len))
        except (RuntimeError, MemoryError) as exc:  # the cache's tensors, allocated whole
            if not isinstance(exc, MemoryError) and "alloc" not in str(exc):
                raise
            from .errors import ConfigError, first_lines

            raise ConfigError(
                "module.batch",
                batch,
                f"a KV cache of {batch} sequence(s) of module.max_cache_len={max_cache_len} positions could not be "
                f"allocated ({first_lines(exc, 1)}); lower either",
            ) from None
        self._bindings: list[tuple[Any, str, str]] = []
        _rehome(self, self._cache.layers, "kv_", self._bindings, set())

    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The logits of every prompt position; the cache starts over at position 0."""
        self._bind_cache()
        for layer in self._cache.layers:
            layer.cumulative_length = torch.zeros((), dtype=torch.long, device=input_ids.device)
        batch, length = input_ids.shape
        positions = torch.arange(length, device=input_ids.device).unsqueeze(0).expand(batch, length)
        return self._run(input_ids, positions)

    def decode(self, input_ids: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """The logits of one token per sequence at `position` (the number of
        tokens cached before it; every sequence of a batch shares it)."""
        self._bind_cache()
        at = position[:1].reshape(())
        for layer in self._cache.layers:  # each layer adds to its own
            layer.cumulative_length = at.to(dtype=torch.long, copy=True)
        return self._run(input_ids, at.reshape(1, 1).expand(input_ids.shape[0], 1))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.prefill(input_ids)

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # Positions given: OPT and GPT-2 would otherwise derive them from the cache's length.
        cache = {self._cache_argument: self._cache}
        return self._model(input_ids=input_ids, position_ids=positions, use_cache=True, **cache).logits

    def _bind_cache(self) -> None:
        """Point the cache's layers at this module's buffers: the tensors
        export traces (and the loaded package binds) are the buffers, on the
        device the module was moved to since."""
        for owner, attribute, name in self._bindings:
            tensor = getattr(self, name)
            setattr(owner, attribute, tensor)
            if isinstance(getattr(owner, "device", None), torch.device):  # a layer makes positions on it
                owner.device = tensor.device

    def _rehome_plain_tensors(self) -> None:
        """A tensor a submodule holds as a plain attribute is lifted by export
        as a constant, and a write into it cannot be functionalised: make
        each one a (non-persistent) buffer of the submodule holding it."""
        for module in self.modules():
            for attribute, value in list(vars(module).items()):
                if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                    del module.__dict__[attribute]
                    module.register_buffer(attribute, value, persistent=False)


def _static_cache(model: Any, batch: int, length: int) -> Any:
    """transformers' StaticCache for `model`, allocated; a sliding-window layer
    kept at full length (its window is the attention mask's), since its ring
    buffer branches on a Python int that export would fix at trace time."""
    from transformers.cache_utils import StaticCache, StaticLayer, StaticSlidingWindowLayer
    from transformers.configuration_utils import get_head_shapes

    class FullLengthSlidingLayer(StaticLayer):
        is_sliding = True

    text = model.config.get_text_config(decoder=True)
    cache = StaticCache(config=text, max_cache_len=length)
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, StaticSlidingWindowLayer):
            cache.layers[i] = FullLengthSlidingLayer(length)
        elif type(layer) is not StaticLayer:
            raise NotImplementedError(
                f"{type(model).__name__}'s cache layer {type(layer).__name__} has no static form here"
            )
    heads, head_dim = get_head_shapes(text)
    cache.early_initialization(batch, heads, head_dim, model.dtype, model.device)
    return cache


def _rehome(owner: nn.Module, obj: Any, prefix: str, bindings: list[tuple[Any, str, str]], seen: set[int]) -> None:
    """Register every tensor reachable from a cache object as a non-persistent
    buffer of `owner` (`kv_0_keys`, ...), remembering where it came from."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            _rehome(owner, item, f"{prefix}{i}_", bindings, seen)
        return
    if isinstance(obj, nn.Module) or not hasattr(obj, "__dict__"):
        return
    for attribute, value in list(vars(obj).items()):
        if attribute == COUNT:  # set by each call (CausalLM.prefill, decode)
            continue
        if isinstance(value, torch.Tensor):
            name = next((n for n, b in owner.named_buffers(recurse=False) if b is value), None)
            if name is None:
                name = f"{prefix}{attribute}"
                owner.register_buffer(name, value, persistent=False)
            bindings.append((obj, attribute, name))
        elif isinstance(value, (list, tuple)) or type(value).__module__.startswith("transformers.cache_utils"):
            _rehome(owner, value, prefix if isinstance(value, (list, tuple)) else f"{prefix}{attribute}_", bindings,
                    seen)  # fmt: skip
