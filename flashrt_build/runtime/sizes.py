"""A `causal_lm` package's sizes (its batch, longest prompt and cache, the
keys a user sets) and a prompt held against them before any call, refused in
the words of those keys with the rebuild that takes it, never one past the
model's own positions. No torch."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .hashing import not_a_file
from .manifest import causal_lm_module

MAX_CONFIG_BYTES = 16 << 20  # a config.json far larger is no model's


class PromptRefused(ConfigError, ValueError):
    """A prompt, or a number of new tokens, the package was not built for:
    the config key that would build one that takes it, with the value this
    package was built with (exit code 2 from the command line; a ValueError
    to callers of `generate`)."""


def declared_inputs(model: Any, method: str) -> list[dict[str, Any]]:
    """A loaded package's manifest entries of `method`'s inputs (none for another module)."""
    methods = getattr(model, "manifest", {}).get("methods") or {}
    return (methods.get(method) or {}).get("inputs") or []


@dataclass(frozen=True)
class BuiltSizes:
    """What a `causal_lm` package was built to take, read from its methods'
    inputs (the resolved values, whatever the config left null)."""

    batch: int
    max_prompt: int
    max_cache_len: int


def built_sizes(model: Any, prefill: str, decode: str, position: str) -> BuiltSizes | None:
    """A `causal_lm` package's sizes; None for any other model (its inputs' own keys apply)."""
    if causal_lm_module(getattr(model, "manifest", None)) is None:
        return None
    prompt = next(iter(declared_inputs(model, prefill)), None)
    at = next((i for i in declared_inputs(model, decode) if i["name"] == position), None)
    if prompt is None or at is None or at.get("high") is None or len(prompt["shape"]) != 2:
        return None
    longest = (prompt["dynamic"].get("1") or {}).get("max", prompt["shape"][1])
    return BuiltSizes(prompt["shape"][0], longest, at["high"])


def check_request(
    sizes: BuiltSizes,
    batch: int,
    length: int,
    max_new_tokens: int,
    positions: Callable[[], int | None] = lambda: None,
    prefilled: bool = True,
) -> None:
    """A `causal_lm` package's prompt and new tokens against what it was
    built for, refused naming `module.batch`, `module.max_prompt` or
    `module.max_cache_len` with the override that would build one that takes
    them; where that build would be refused (more positions than the model
    has: `positions()`, read only to refuse), the most the model can take.
    A prompt not `prefilled` (a conversation's turn decoded from the cache)
    is bounded by the cache alone."""
    if not prefilled:
        sizes = dataclasses.replace(sizes, max_prompt=max(sizes.max_prompt, length))
    if batch != sizes.batch:
        raise PromptRefused(
            "module.batch",
            sizes.batch,
            f"the package decodes {sizes.batch} sequence(s) at once and the prompt holds {batch}; "
            f"rebuild with module.batch={batch}",
        )
    last = length + max_new_tokens - 1  # the position of the last new token
    if length <= sizes.max_prompt and last < sizes.max_cache_len:
        return
    most = positions() if last + 1 > sizes.max_cache_len else None  # the model's, where a bigger cache is asked
    has = f"the model has {most} positions (its config.json's max_position_embeddings)"
    if length > sizes.max_prompt:
        said = f"the prompt has {length} tokens, more than the package's prefill takes; "
        if most is None or last < most:
            cache = f" module.max_cache_len={last + 1}" if last >= sizes.max_cache_len else ""
            advice = f"rebuild with module.max_prompt={length}{cache}"
        elif length < most:  # the prompt fits the model, not with this many new tokens
            advice = (
                f"{has}: rebuild with module.max_prompt={length} module.max_cache_len={most} and ask for at most "
                f"{most - length} new tokens"
            )
        else:
            advice = f"{has}, so no build of it takes a prompt of {length} tokens: give one of at most {most - 1}"
        raise PromptRefused("module.max_prompt", sizes.max_prompt, said + advice)
    fewer = sizes.max_cache_len - length
    instead = f"ask for at most {fewer} new tokens" if fewer >= 1 else ""
    if most is None or last < most:
        advice = f"rebuild with module.max_cache_len={last + 1}" + (f", or {instead}" if instead else "")
    elif most > sizes.max_cache_len:
        advice = f"{has}: rebuild with module.max_cache_len={most} to ask for at most {most - length} new tokens" + (
            f", or {instead}" if instead else ""
        )
    else:
        advice = f"{has}, all of them in this cache" + (f": {instead}" if instead else "")
    raise PromptRefused(
        "module.max_cache_len",
        sizes.max_cache_len,
        f"the prompt ({length} tokens) and {max_new_tokens} new tokens need positions up to {last}, "
        f"the package's cache holds {sizes.max_cache_len}; {advice}",
    )


def model_positions(manifest: Mapping[str, Any]) -> int | None:
    """The positions a `causal_lm` package's model has (its config.json's
    `max_position_embeddings`, or `n_positions`): the most `module.max_cache_len`
    a rebuild takes. Read from the config.json the build read (its
    `build_inputs`), where that is still a readable JSON file; else None."""
    module = causal_lm_module(manifest)
    if module is None:
        return None
    recorded = [
        record.get("path")
        for record in manifest.get("build_inputs") or []
        if isinstance(record, Mapping) and record.get("file") == "config.json"
    ]
    paths = [Path(p) for p in recorded if isinstance(p, str)] or [Path(str(module["pretrained"])) / "config.json"]
    for path in paths:
        try:
            if not_a_file(path) is not None or path.stat().st_size > MAX_CONFIG_BYTES:
                continue  # never opened: a FIFO would block
            config = json.loads(path.read_bytes())
        except (OSError, ValueError):
            continue
        if not isinstance(config, dict):
            continue
        config = config["text_config"] if isinstance(config.get("text_config"), dict) else config
        found = config.get("max_position_embeddings") or config.get("n_positions")
        if isinstance(found, int) and not isinstance(found, bool) and found >= 1:
            return found
    return None


def check_methods(model: Any, **names: str) -> None:
    """Each of `names` (by the role it plays) is a method of `model` generation
    may call: a loaded package's (by its manifest), or a public callable of an
    eager module."""
    methods = getattr(model, "methods", None)
    for role, name in names.items():
        if isinstance(methods, dict) and methods:  # a loaded package
            if name not in methods:
                listed = ", ".join(methods)
                raise ValueError(f"{role}={name!r}: the package has no method {name!r}; its methods: {listed}")
        elif not isinstance(name, str) or name.startswith("_") or not callable(getattr(model, name, None)):
            raise ValueError(f"{role}={name!r}: {type(model).__name__} has no method {name!r} to generate with")
