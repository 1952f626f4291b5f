"""Checkpoints against a built package: read them, compare them, bind them.

The comparison needs only names, shapes and dtypes, so `check` answers without
loading the package or any tensor data. `load` uses the same comparison
before binding, because torch accepts a wrong shape silently.
"""

from __future__ import annotations

import json
import pickle
import struct
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError, WeightsMismatch, first_lines
from .dtypes import FLOATING, SAFETENSORS, dtype_name
from .formats import Checkpoint, checkpoint_format, resolve_checkpoint
from .manifest import quantized_originals, read_manifest


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
                    f"lacks {_first(absent)}" if absent else "",
                    f"also holds {_first(extra)}" if extra else "",
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
    view = memoryview(into.view(torch.uint8).numpy())
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise ConfigError("module.checkpoint", str(file), f"ends inside tensor {name}: the file is truncated")
        got += n


def _first(items: list[str], shown: int = 5) -> str:
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


def required(entry: Mapping[str, Any]) -> bool:
    """A checkpoint must supply parameters and persistent buffers; constants of
    the forward's code and non-persistent buffers default to the build's values."""
    return entry["kind"] == "parameter" or (entry["kind"] == "buffer" and entry.get("persistent", True))


def match_names(
    entries: list[Mapping[str, Any]], names: Iterable[str], unused: Iterable[str] = ()
) -> tuple[dict[str, str], list[str], list[str]]:
    """Pair package FQNs with a checkpoint's names (its own, its export name, or
    a tied alias); names the graph never reads (`unused`) are neither bound nor
    unexpected. Returns (fqn -> checkpoint name, missing fqns, unexpected names)."""
    names = set(names)
    chosen: dict[str, str] = {}
    known: set[str] = set(unused)
    for entry in entries:
        candidates = [entry["fqn"], entry.get("source"), *entry.get("aliases", [])]
        known.update(c for c in candidates if c)
        found = next((c for c in candidates if c in names), None)
        if found is not None:
            chosen[entry["fqn"]] = found
    missing = [e["fqn"] for e in entries if e["fqn"] not in chosen and required(e)]
    unexpected = sorted(names - known)
    return chosen, missing, unexpected


def expected_stride(entry: Mapping[str, Any]) -> list[int]:
    """The strides a package reads a tensor with: the build's own (manifests
    record them), else row-major. A compiled kernel indexes with them, so a
    tensor of the right shape laid out otherwise gives wrong answers, silently."""
    if entry.get("stride") is not None:
        return list(entry["stride"])
    stride, step = [], 1
    for size in reversed(entry["shape"]):
        stride.append(step)
        step *= max(size, 1)
    return stride[::-1]


def same_layout(stride: Iterable[int], entry: Mapping[str, Any]) -> bool:
    """Do `stride` and the package agree? Axes of size 1 are never stepped along."""
    return all(s == e for s, e, n in zip(stride, expected_stride(entry), entry["shape"], strict=True) if n > 1)


def laid_out(tensor: torch.Tensor, entry: Mapping[str, Any]) -> torch.Tensor:
    """`tensor` (read from a file, row-major) as the package reads it: its
    strides, and its floating-point dtype (a bf16 checkpoint for a float32
    package); a copy only where either differs."""
    dtype = getattr(torch, entry["dtype"])
    if same_layout(tensor.stride(), entry) and tensor.dtype == dtype:
        return tensor
    laid = torch.empty_strided(tensor.shape, expected_stride(entry), dtype=dtype, device=tensor.device)
    return laid.copy_(tensor)


def compare(
    entries: list[Mapping[str, Any]],
    table: Mapping[str, tuple[list[int], str]],
    device: torch.device | None = None,
    devices: Mapping[str, torch.device] | None = None,
    unused: Iterable[str] = (),
    strides: Mapping[str, Iterable[int]] | None = None,
) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Every difference between a package's tensors and a checkpoint, by kind.
    `strides`: of tensors bound as they are (the caller's own), which must be
    laid out as the package reads them; a file's are laid out when read."""
    chosen, missing, unexpected = match_names(entries, table, unused)
    by_fqn = {e["fqn"]: e for e in entries}
    problems: dict[str, list[str]] = {"missing": missing, "unexpected": unexpected}
    for fqn, name in sorted(chosen.items()):
        shape, dtype = table[name]
        want = by_fqn[fqn]
        if list(shape) != want["shape"]:
            problems.setdefault("wrong shape", []).append(f"{name} {list(shape)} (package expects {want['shape']})")
        # A file's floating-point tensors are cast when read; the caller's own (bound as they are) are not.
        cast = strides is None and dtype in FLOATING and want["dtype"] in FLOATING
        if dtype != want["dtype"] and not cast:
            problems.setdefault("wrong dtype", []).append(f"{name} {dtype} (package expects {want['dtype']})")
        if device is not None and devices is not None and not _same_device(devices[name], device):
            problems.setdefault("wrong device", []).append(f"{name} on {devices[name]} (package runs on {device})")
        if strides is not None and list(shape) == want["shape"] and not same_layout(strides[name], want):
            problems.setdefault("wrong strides", []).append(
                f"{name} strides {list(strides[name])} (package expects {expected_stride(want)}: "
                "bind a .contiguous() copy, or the build's layout)"
            )
    return chosen, {kind: names for kind, names in problems.items() if names}


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.type != "cuda" or (a.index or 0) == (b.index or 0))


def check_checkpoint(output_dir: str | Path, checkpoint: str | Path) -> dict[str, list[str]]:
    """Does `checkpoint` fit the package in `output_dir`? Every difference, by
    kind; empty when it fits. Loads neither the package nor tensor data."""
    manifest = read_manifest(Path(output_dir))
    files = CheckpointFiles(as_argument("CHECKPOINT", checkpoint), "CHECKPOINT", "argument")
    table = {name: entry for file_table in files.tables().values() for name, entry in file_table.items()}
    weights = manifest["weights"]
    # State buffers (a KV cache) are bound apart: a checkpoint may hold them, as `load` accepts.
    accepted = [*weights.get("unused", []), *(t["fqn"] for t in (manifest.get("state") or {}).get("tensors", []))]
    _, problems = compare(float_view(weights["tensors"], manifest.get("quant")), table, unused=accepted)
    return problems


def float_view(entries: list[Mapping[str, Any]], quant: Mapping[str, Any] | None) -> list[Mapping[str, Any]]:
    """A quantized package's tensors as a float checkpoint names them: each
    quantized weight once, by its own FQN, shape and dtype (the manifest's
    `quant.modules`), in place of the parts the package binds."""
    if not quant:
        return entries
    view = [e for e in entries if not e.get("quantized")]
    for fqn in quantized_originals(entries):
        module = quant["modules"][fqn.rpartition(".")[0]]
        view.append({"fqn": fqn, "shape": module["shape"], "dtype": module["dtype"], "kind": "parameter"})
    return view


def check_loading_report(report: Mapping[str, Any], key: str, value: object) -> None:
    """transformers' `from_pretrained` loads what matches and initialises the
    rest randomly, with a warning; a build must not publish random weights as
    trained ones, so anything missing, unexpected or of another shape in its
    loading report is a ConfigError naming `key`, as a checkpoint that does
    not fit is."""
    kinds = {"missing": "missing_keys", "unexpected": "unexpected_keys", "wrong shape": "mismatched_keys"}
    found = {label: sorted(map(str, report.get(name) or ())) for label, name in kinds.items()}
    problems = [f"{len(names)} {label}: {_first(names)}" for label, names in found.items() if names]
    if problems:
        raise ConfigError(
            key,
            value,
            "holds weights that do not fit the model transformers built from it (it would initialise what is "
            "missing randomly): " + "; ".join(problems),
        )


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


__all__ = ["WeightsMismatch", "check_checkpoint", "checkpoint_table", "compare", "read_checkpoint"]
