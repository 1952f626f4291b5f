"""A checkpoint loaded into the module strictly, one chunk at a
time, tied weights given once, names renamed by the config's rules."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from ..errors import ConfigError
from ..runtime.dtypes import FLOATING, dtype_name
from ..runtime.formats import Checkpoint
from ..runtime.reader import CheckpointFiles

log = logging.getLogger(__name__)


def load_checkpoint(module: torch.nn.Module, checkpoint: Checkpoint, rename: Sequence[tuple[str, str]] = ()) -> int:
    """Load a checkpoint strictly, one tensor at a time (shards memory-mapped:
    no second copy of the weights is ever held); returns how many tensors.

    Every name of the module's state dict must be in the checkpoint, after
    `rename` (first matching rule wins), unless a tensor it is tied to (the
    same storage: `lm_head.weight` and `wte.weight`) is there, which is how
    `save_pretrained` writes tied weights; nothing else may be there. Shapes
    must match; a floating-point tensor is cast to the module's dtype (a bf16
    checkpoint into a float32 build), any other dtype must match."""
    files = CheckpointFiles(checkpoint)
    own = module.state_dict(keep_vars=True)
    tied = _tied_groups(own)
    found = _found(checkpoint, files, rename)
    _check_fit(checkpoint, found, own, tied)
    loaded: dict[str, str] = {}  # module name -> the checkpoint name its storage was written from
    with torch.no_grad():
        for file in checkpoint.files:
            direct, twins = {}, []
            for target, (where, name, _, _) in found.items():
                if where != file:
                    continue
                twin = next((t for t in tied.get(target, ()) if t in loaded), None)
                if twin is None:
                    direct[name] = own[target]
                    loaded[target] = name
                else:
                    twins.append((twin, name))
            files.copy_into(file, direct)  # straight into the module's tensors, a chunk at a time
            for twin, name in twins:  # tied weights given twice must agree
                if not torch.equal(own[twin], files.read(file, name).to(own[twin].dtype)):
                    raise ConfigError(
                        "module.checkpoint",
                        str(checkpoint.path),
                        f"holds different values for {loaded[twin]} and {name}, which the module ties together",
                    )
    log.debug("loaded %d tensors from %s", len(loaded), checkpoint.path)
    return len(loaded)


Found = dict[str, tuple[Path, str, list[int], str]]  # module name -> (file, name in it, shape, dtype)


def _found(checkpoint: Checkpoint, files: CheckpointFiles, rename: Sequence[tuple[str, str]]) -> Found:
    """Every checkpoint tensor by the module name it loads into, after `rename`."""
    found: Found = {}
    for file, table in files.tables().items():
        for name, (shape, dtype) in table.items():
            target = _renamed(name, rename)
            if target in found:
                first = found[target][1]
                rules = [{"pattern": pattern, "replace": replace} for pattern, replace in rename]
                raise ConfigError(
                    "module.checkpoint_rename" if rename else "module.checkpoint",
                    rules if rename else str(checkpoint.path),
                    f"two checkpoint tensors, {first} and {name}, both name the module's {target}"
                    + (f" (in {checkpoint.path})" if rename else ""),
                )
            found[target] = (file, name, shape, dtype)
    return found


def _check_fit(
    checkpoint: Checkpoint, found: Found, own: Mapping[str, torch.Tensor], tied: Mapping[str, tuple[str, ...]]
) -> None:
    """Nothing missing (a tied twin may stand in), nothing unexpected, every shape and dtype fits."""
    missing = sorted(n for n in own if n not in found and not any(t in found for t in tied.get(n, ())))
    unexpected = sorted(name for target, (_, name, _, _) in found.items() if target not in own)
    wrong = [_mismatch(checkpoint, target, entry, own[target]) for target, entry in found.items() if target in own]
    problems = [
        f"{len(items)} {label}: {_first(items)}"
        for label, items in (("missing", missing), ("unexpected", unexpected), ("wrong", [w for w in wrong if w]))
        if items
    ]
    if problems:
        hint = "; module.checkpoint_rename maps its names to the module's" if unexpected and missing else ""
        raise ConfigError(
            "module.checkpoint", str(checkpoint.path), "does not fit the module: " + "; ".join(problems) + hint
        )


def _renamed(name: str, rename: Sequence[tuple[str, str]]) -> str:
    for pattern, replacement in rename:
        renamed, count = re.subn(pattern, replacement, name)
        if count:
            return renamed
    return name


def _tied_groups(own: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, ...]]:
    """Each name of the state dict -> the other names sharing its storage."""
    by_storage: dict[tuple, list[str]] = {}
    for name, tensor in own.items():
        if tensor.numel():
            layout = (
                tensor.untyped_storage().data_ptr(),
                tensor.storage_offset(),
                tuple(tensor.shape),
                tensor.stride(),
            )
            by_storage.setdefault(layout, []).append(name)
    return {n: tuple(m for m in names if m != n) for names in by_storage.values() if len(names) > 1 for n in names}


def _mismatch(checkpoint: Checkpoint, target: str, entry: tuple[Path, str, list[int], str], want: torch.Tensor) -> str:
    file, name, shape, dtype = entry
    where = f"{name} in {checkpoint.name(file)}"
    if list(shape) != list(want.shape):
        return f"{where}: shape {list(shape)}, the module's {target} is {list(want.shape)}"
    module_dtype = dtype_name(want.dtype)
    if dtype != module_dtype and not (dtype in FLOATING and module_dtype in FLOATING):
        return f"{where}: dtype {dtype}, the module's {target} is {module_dtype}"
    return ""


def _first(items: list[str], shown: int = 5) -> str:
    return ", ".join(items[:shown]) + (f" and {len(items) - shown} more" if len(items) > shown else "")
