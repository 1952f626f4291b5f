"""The name of a build's output folder, the same from the command line and
from `compose()`:

    <output_root>/<module.name>/<target>-<weights>-<inductor>[-<quant>][-<passes>][-<variant>]

The variant names every value that differs from what the chosen configs
(the module, target, inductor and quant files) say, for keys that change the
artifact: `seed=1` adds `seed_1`, `seed=0` (the default) nothing; a
checkpoint adds `ckpt_<its name>`, a directory a path names its name; where
to build, how to check it, the allow-list and the import path add nothing."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

# Top-level keys that leave the artifact as it is, or name it already.
UNNAMED = frozenset(
    {
        "module.name", "target.name", "inductor.name", "quant.name", "passes.name",  # the folder's other parts
        "module.pretrained",  # causal_lm's folder is named after it (module.name)
        "weights",
        "output_root", "output_dir", "variant", "verify", "force", "threads",  # where and how, not what
        "allowed_targets", "python_path", "hydra",  # policy and lookup
    }
)  # fmt: skip
# Longer variant names keep their start and end in a digest of the whole.
MAX_VARIANT = 96


def variant_of(config: Mapping[str, Any], baseline: Mapping[str, Any]) -> str | None:
    """A directory-safe suffix naming where `config` differs from `baseline`
    (the same configs without the overrides), or None when it does not."""
    parts = []
    for key, value in _differences(config, baseline, ""):
        if key == "module.checkpoint" and value:  # which checkpoint, not where it is
            key, value = "ckpt", _stem(str(value))
        elif isinstance(value, str) and "/" in value and Path(value).name:  # a path: its name
            key, value = key.rpartition(".")[2], Path(value).name
        parts.append(re.sub(r"[^A-Za-z0-9_.=-]+", "_", f"{key}={_text(value)}"))
    variant = ",".join(parts).replace("=", "_").replace(",", "-").strip("_")
    if len(variant) > MAX_VARIANT:  # a file name holds 255 bytes; the lock and staging names add to it
        variant = f"{variant[: MAX_VARIANT - 13]}-{hashlib.sha256(variant.encode()).hexdigest()[:12]}"
    return variant or None


def group_overrides(overrides: Sequence[str], is_group: Any) -> list[str]:
    """The overrides that choose a config file (`+module=mlp`, `quant=int8_wo`,
    `hydra/launcher=parallel`): what the baseline is composed from."""
    chosen = []
    for override in overrides:
        key = override.partition("=")[0].lstrip("+~")
        if "=" in override and "." not in key and is_group(key):
            chosen.append(override)
    return chosen


def names_nothing(overrides: Sequence[str], chosen: Sequence[str]) -> bool:
    """Whether the overrides beyond the `chosen` config files set only keys
    the variant never names (`output_root=...`, `verify.rtol=...`): then the
    config is its own baseline, and composing it again would change nothing."""
    for override in overrides:
        if override in chosen:
            continue
        key = override.partition("=")[0].lstrip("+~")
        if not any(key == unnamed or key.startswith(f"{unnamed}.") for unnamed in UNNAMED):
            return False
    return True


def _differences(config: Any, baseline: Any, key: str) -> Iterator[tuple[str, Any]]:
    if key in UNNAMED:
        return
    if isinstance(config, Mapping) and isinstance(baseline, Mapping):
        for name, value in config.items():
            yield from _differences(value, baseline.get(name, _ABSENT), f"{key}.{name}" if key else str(name))
    elif config != baseline and config is not _ABSENT:
        yield key, config


_ABSENT = object()


def _stem(path: str) -> str:
    p = Path(path)
    return p.name if not p.suffix or p.name.startswith(".") else p.stem


def _text(value: Any) -> str:
    if isinstance(value, Mapping):
        return "_".join(f"{k}_{_text(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return "_".join(_text(v) for v in value)
    return str(value).lower() if isinstance(value, bool) else str(value)
