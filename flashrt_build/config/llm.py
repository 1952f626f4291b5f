"""What the `causal_lm` config reads from a `save_pretrained` directory,
without torch: the vocabulary size (the token ids' range), the cache length
(the model's positions, capped), and the files a served model needs beside
its package (the tokenizer, the generation config). A config names them with
`${flashrt_llm:WHAT,${module.pretrained}[,GIVEN]}`; the resolved values are
the build's, recorded in its manifest."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..runtime.formats import check_pretrained_dir
from .files import SERVING_FILES

# A cache this long holds a 1B model's keys and values in about 130 MB (bf16);
# longer contexts are a choice to make, not a default.
MAX_DEFAULT_CACHE = 4096


def text_config(pretrained: str) -> dict[str, Any]:
    """The decoder's config of a save_pretrained directory (a multimodal
    model's `text_config`)."""
    check_pretrained_dir("module.pretrained", pretrained, Path(pretrained).expanduser())
    path = Path(pretrained).expanduser() / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError("module.pretrained", pretrained, f"has a config.json that does not parse ({exc})") from None
    if not isinstance(config, dict):
        raise ConfigError("module.pretrained", pretrained, "has a config.json that is not a JSON object")
    return config.get("text_config") or config


def llm_value(what: str, pretrained: str | None, given: Any = None, fallback: Any = None) -> Any:
    """The OmegaConf resolver `flashrt_llm`: `name` (the directory's, the
    output folder's); `vocab_size`; `cache_len` (given,
    else the model's positions, at most MAX_DEFAULT_CACHE); `max_prompt`
    (given, else `fallback`: the cache's length); `example_prompt` (the
    example's length, within `given`, the longest prompt); `files` (the
    serving files the directory holds)."""
    if what == "max_prompt":
        if given is None:
            return fallback
        if not isinstance(given, int) or not 2 <= given <= fallback:  # the prompt's length is a dim from 1 to it
            raise ConfigError(
                "module.max_prompt", given, f"expected a prompt length from 2 to module.max_cache_len ({fallback})"
            )
        return given
    if what == "example_prompt":
        return max(1, min(8, int(given)))
    if what == "name":  # the output folder's: the model's directory, as the user knows it
        folder = Path(os.path.abspath(Path(pretrained).expanduser())).name if pretrained else ""
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", folder).strip("._") or "causal_lm"
    if pretrained is None:
        raise ConfigError("module.pretrained", None, "a save_pretrained directory is required: module.pretrained=DIR")
    directory = Path(pretrained).expanduser()
    if what == "files":
        return serving_files(pretrained, directory)
    config = text_config(pretrained)
    if what == "vocab_size":
        return _positive(config.get("vocab_size"), "vocab_size", pretrained)
    if what == "cache_len":
        positions = config.get("max_position_embeddings") or config.get("n_positions")
        positions = positions and _positive(positions, "max_position_embeddings", pretrained)
        if given is None:
            return min(positions or MAX_DEFAULT_CACHE, MAX_DEFAULT_CACHE)
        if not isinstance(given, int) or given < 2:  # a prompt's length is a dim from 1 to at most it
            raise ConfigError("module.max_cache_len", given, "expected the positions the KV cache holds, at least 2")
        if positions and given > positions:
            raise ConfigError(
                "module.max_cache_len",
                given,
                f"the model has {positions} positions (its config.json's max_position_embeddings); expected at "
                "most that",
            )
        return given
    raise ValueError(f"flashrt_llm: unknown value {what!r}")


def serving_files(pretrained: str, directory: Path) -> list[str]:
    """The serving files a directory holds, each a regular file: one of their
    names that is something else (a FIFO, a link to a device) is refused, not
    left out (the served model would lack its tokenizer)."""
    found = []
    for name in sorted(SERVING_FILES):
        path = directory / name
        if path.is_file():
            found.append(str(path))
        elif os.path.lexists(path):
            raise ConfigError(
                "module.pretrained", pretrained, f"holds {name}, which is not a regular file: a served file must be one"
            )
    return found


def _positive(value: Any, name: str, pretrained: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError("module.pretrained", pretrained, f"has a config.json whose {name} is {value!r}, not a size")
    return value


def register_resolvers() -> None:
    """`${flashrt_llm:...}` for the configs (idempotent)."""
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("flashrt_llm", llm_value, replace=True)
