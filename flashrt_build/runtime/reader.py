"""Checkpoints read, never unpickling code: a safetensors file by its
header and a chunk at a time straight into a module's tensors (no second copy
of the weights), a torch state dict memory-mapped with `weights_only`; a
sharded directory's every shard held against its index. What is wrong with a
file is a ConfigError naming the config key or the argument that gave it."""

from __future__ import annotations

import json
import pickle
import struct
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError, first_lines
from .dtypes import SAFETENSORS, dtype_name
from .formats import Checkpoint, checkpoint_format, resolve_checkpoint


def read_checkpoint(
    path: Path, device: str | torch.device = "cpu", key: str = "module.checkpoint", kind: str = "config key"
) -> dict[str, torch.Tensor]:
    """A state dict from a safetensors file or a torch file, never unpickling
    code. What is wrong with the file is a ConfigError naming `key`, which is
    a config key or, for `load(weights=...)` and `check`, an argument (`kind`)."""
    path = Path(path)
    if _format(path, key, kind) == "safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(path), device=str(device))
        except Exception as exc:
            raise ConfigError(
                key, str(path), f"is not a readable safetensors file ({first_lines(exc)})", kind
            ) from None
    return _torch_state(path, device, key, kind)


def _format(path: Path, key: str, kind: str) -> str:
    try:
        return checkpoint_format(path)
    except FileNotFoundError:
        raise ConfigError(key, str(path), "no such file", kind) from None
    except OSError as exc:
        raise ConfigError(key, str(path), f"cannot be read ({exc.strerror or exc})", kind) from None
    except ValueError as exc:
        raise ConfigError(key, str(path), f"is {exc}", kind) from None


class CheckpointFiles:
    """A checkpoint's tensors, read file by file into their destinations, so
    a build from an N GB checkpoint holds no second copy of it: safetensors
    shards are read a chunk at a time straight into the module's own tensors;
    torch files are loaded memory-mapped (weights only, never unpickling
    code; a Lightning `state_dict` unwrapped)."""

    CHUNK_BYTES = 64 << 20

    def __init__(self, checkpoint: Checkpoint, key: str = "module.checkpoint", kind: str = "config key") -> None:
        self.checkpoint, self.key, self.kind = checkpoint, key, kind

    def table(self, file: Path) -> dict[str, tuple[list[int], str]]:
        """Name -> (shape, dtype) of one file's tensors; a safetensors file's header only."""
        if self.checkpoint.format == "safetensors":
            return checkpoint_table(file, self.key, self.kind)
        return {name: (list(t.shape), dtype_name(t.dtype)) for name, t in self._torch(file).items()}

    def tables(self) -> dict[Path, dict[str, tuple[list[int], str]]]:
        """Every file's table, in order, once each shard is checked against
        its directory's index: a tensor the index places in one shard and
        another shard also holds would otherwise bind whichever came last."""
        tables = {}
        for file in self.checkpoint.files:
            tables[file] = table = self.table(file)
            self._check_index(file, table)
        return tables

    def _check_index(self, file: Path, table: Mapping[str, Any]) -> None:
        """A sharded checkpoint's index and the shard's own header must agree on what it holds."""
        if not self.checkpoint.weight_map:
            return
        listed = {name for name, shard in self.checkpoint.weight_map.items() if shard == file.name}
        if listed != set(table):
            absent, extra = sorted(listed - set(table)), sorted(set(table) - listed)
            said = "; ".join(
                part
                for part in (
                    f"lacks {first_of(absent)}" if absent else "",
                    f"also holds {first_of(extra)}" if extra else "",
                )
                if part
            )
            raise ConfigError(
                self.key,
                str(self.checkpoint.path),
                f"shard {file.name} does not hold what its index says: {said}",
                self.kind,
            )

    def read(self, file: Path, name: str) -> torch.Tensor:
        """One tensor of one file, whole."""
        if self.checkpoint.format == "safetensors":
            from safetensors import safe_open

            with safe_open(str(file), framework="pt", device="cpu") as f:
                return f.get_tensor(name)
        return self._torch(file)[name]

    def copy_into(self, file: Path, targets: Mapping[str, torch.Tensor]) -> None:
        """Copy each named tensor of `file` into its target (same shape; a
        floating dtype is cast), one chunk of a safetensors file at a time."""
        if self.checkpoint.format != "safetensors":
            state = self._torch(file)
            for name, target in targets.items():
                target.copy_(state[name])
            return
        header, data_start = safetensors_header(file)
        with open(file, "rb") as f:
            for name, target in targets.items():
                entry = header[name]
                dtype = getattr(torch, SAFETENSORS[entry["dtype"]])
                if not target.is_contiguous():
                    target.copy_(self.read(file, name))
                    continue
                f.seek(data_start + entry["data_offsets"][0])
                flat, per = target.view(-1), max(1, self.CHUNK_BYTES // dtype.itemsize)
                staging = None if dtype == target.dtype else torch.empty(min(per, flat.numel()), dtype=dtype)
                for begin in range(0, flat.numel(), per):
                    count = min(per, flat.numel() - begin)
                    into = flat[begin : begin + count] if staging is None else staging[:count]
                    _read_exactly(f, into, file, name)
                    if staging is not None:
                        flat[begin : begin + count].copy_(into)

    def _torch(self, file: Path) -> dict[str, torch.Tensor]:
        return _torch_state(file, "cpu", self.key, self.kind, mmap=zipfile.is_zipfile(file))  # legacy: no mmap


def safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's header and where its data starts."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length)), 8 + length


def _read_exactly(f: Any, into: torch.Tensor, file: Path, name: str) -> None:
    """Fill `into` (contiguous, on the CPU) with the file's next bytes."""
    view = into.view(torch.uint8).numpy().data
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise ConfigError("module.checkpoint", str(file), f"ends inside tensor {name}: the file is truncated")
        got += n


def first_of(items: list[str], shown: int = 5) -> str:
    return ", ".join(items[:shown]) + (f" and {len(items) - shown} more" if len(items) > shown else "")


def _torch_state(
    path: Path, device: str | torch.device, key: str, kind: str, mmap: bool = False
) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(path, map_location=device, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        why = f"holds objects that need code to unpickle, which is never run ({first_lines(exc, 1)})"
        raise ConfigError(key, str(path), why, kind) from None
    except Exception as exc:
        raise ConfigError(key, str(path), f"is not a readable state dict ({first_lines(exc)})", kind) from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]  # the Lightning layout
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(key, str(path), "expected a mapping of names to tensors", kind)
    return state


def checkpoint_table(
    path: Path, key: str = "module.checkpoint", kind: str = "config key"
) -> dict[str, tuple[list[int], str]]:
    """Name -> (shape, dtype) of a checkpoint, reading no tensor data if it is safetensors."""
    path = Path(path)
    if _format(path, key, kind) == "safetensors":
        from safetensors import safe_open

        table = {}
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                sl = f.get_slice(name)
                table[name] = (list(sl.get_shape()), SAFETENSORS.get(sl.get_dtype(), sl.get_dtype()))
        return table
    return {name: (list(t.shape), dtype_name(t.dtype)) for name, t in read_checkpoint(path, "meta", key, kind).items()}


def as_argument(name: str, path: str | Path) -> Checkpoint:
    """A checkpoint given to `load` or `check` (a file, or a directory as
    save_pretrained writes it), checked as the config's would be; a problem
    names the argument."""
    try:
        return resolve_checkpoint(name, str(path), Path(path))
    except ConfigError as exc:
        raise ConfigError(name, exc.value, exc.expected, "argument") from None


def read_all(checkpoint: Checkpoint, device: str | torch.device, name: str) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint's files, on `device`, each from the one
    shard its index places it in (checked first, as the build checks it)."""
    CheckpointFiles(checkpoint, name, "argument").tables()
    tensors: dict[str, torch.Tensor] = {}
    for file in checkpoint.files:
        tensors.update(read_checkpoint(file, device, name, "argument"))
    return tensors
