"""Checkpoints against a built package: matched by name (its own, its
export name, a tied alias), compared by shape, dtype, device and layout, laid
out as the package reads them; and transformers' loading report held to the
same standard. Reading the files is reader.py.

The comparison needs only names, shapes and dtypes, so `check` answers without
loading the package or any tensor data. `load` uses the same comparison
before binding, because torch accepts a wrong shape silently.
"""

from __future__ import annotations

import contextlib
import json
import logging
import pickle
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError, WeightsMismatch
from .dtypes import FLOATING
from .manifest import fused_tensors, quantized_originals, read_manifest
from .reader import CheckpointFiles, as_argument, checkpoint_table, first_of, read_checkpoint


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
    entries = unfused_view(float_view(weights["tensors"], manifest.get("quant")), manifest, table)
    _, problems = compare(entries, table, unused=accepted)
    if Path(checkpoint).is_dir() and (differing := config_differences(manifest, Path(checkpoint))):
        problems["another config.json"] = differing
    return problems


def unfused_view(
    entries: list[Mapping[str, Any]], manifest: Mapping[str, Any], names: Mapping[str, Any]
) -> list[Mapping[str, Any]]:
    """A package of fused projections (`passes`) as a checkpoint that names
    the unfused tensors sees it, where it does: each fused tensor's rows, by
    the names the manifest maps them to (what `load` fuses at load). Where
    the checkpoint names some of a fused tensor's parts, the fused tensor is
    seen as its parts too, so a part it lacks is named missing (k_proj), not
    the fused tensor, with the parts it has named unexpected."""
    by_fqn = {e["fqn"]: e for e in entries}
    for name, parts in fused_tensors(manifest):
        whole = by_fqn.get(name)
        if whole is None or name in names or not any(part in names for part, _ in parts):
            continue
        del by_fqn[name]
        for part, (start, end) in parts:
            by_fqn[part] = {**whole, "fqn": part, "shape": [end - start, *whole["shape"][1:]]}
    return list(by_fqn.values())


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


# What a build passes to transformers' `from_pretrained` unless its config sets
# it: the loading report returned (every wrongly shaped tensor in it, rather
# than raised after a table printed), and none of the directory's own code run
# (`auto_map`), never a question asked on the terminal.
FROM_PRETRAINED = {"output_loading_info": True, "ignore_mismatched_sizes": True, "trust_remote_code": False}


@contextlib.contextmanager
def loading_pretrained(key: str, value: object) -> Iterator[None]:
    """transformers' `from_pretrained` inside: its loading report's table kept
    off the terminal (`check_loading_report` says it in one line), and its
    refusal to run a directory's own code said as the config's."""
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    except Exception as exc:
        cause = exc.__cause__ if exc.__cause__ is not None else exc  # as raised, or as Hydra wrapped it
        if _unpickling_refused(cause):
            raise ConfigError(
                key,
                value,
                "holds a torch checkpoint that unpickles only by running code (torch's weights_only load refused "
                "it; none of it ran): save its weights as safetensors",
            ) from None
        if not (isinstance(cause, ValueError) and "trust_remote_code" in str(cause)):
            raise
        raise ConfigError(
            key,
            value,
            "holds a model whose config.json maps it to code of its own (auto_map) that transformers does not "
            "ship; a build runs none of a checkpoint's code unless module.model.trust_remote_code=true (refused "
            "under release or allowed_targets)",
        ) from None
    finally:
        logger.setLevel(level)


# config.json keys that name where a checkpoint came from or how it was saved,
# not the computation the package holds: another checkpoint may differ in them.
PROVENANCE_KEYS = frozenset(
    {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "architectures", "auto_map", "use_cache",
     "bos_token_id", "eos_token_id", "pad_token_id", "_commit_hash", "transformers_weights"}
)  # fmt: skip


def config_differences(manifest: Mapping[str, Any], directory: Path) -> list[str]:
    """Where a save_pretrained directory's config.json differs from the one
    the package was built from (a rope_theta, an activation, a norm's eps:
    the same tensors, another computation); empty when it does not or when
    either is not there to compare."""
    built = (manifest.get("module") or {}).get("model_config")
    path = directory / "config.json"
    if not isinstance(built, dict) or not path.exists():
        return []
    if not path.is_file():  # a FIFO would block the read; it is no config to serve with
        return ["config.json is not a regular file"]
    try:
        given = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return [f"config.json does not parse ({exc})"]
    if not isinstance(given, dict):
        return ["config.json is not a JSON object"]
    built, given = _with_defaults(built), _with_defaults(given)
    keys = sorted((set(built) | set(given)) - PROVENANCE_KEYS)
    return [f"{key}: {given.get(key)!r} (the package was built with {built.get(key)!r})" for key in keys
            if given.get(key) != built.get(key)]  # fmt: skip


def _with_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """A config.json's keys with transformers' defaults for those it leaves
    out (a key omitted is its default), where transformers is installed."""
    try:
        from transformers import AutoConfig

        return dict(AutoConfig.for_model(**config).to_dict())
    except Exception:  # noqa: BLE001 - no transformers, or a model type it does not know: the keys as written
        return config


def _unpickling_refused(exc: BaseException) -> bool:
    """Did torch's weights_only load refuse a pickle somewhere in this chain?"""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return False
        if isinstance(seen, pickle.UnpicklingError) or "Weights only load failed" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def check_loading_report(report: Mapping[str, Any], key: str, value: object) -> None:
    """transformers' `from_pretrained` loads what matches and initialises the
    rest randomly, with a warning; a build must not publish random weights as
    trained ones, so anything missing, unexpected or of another shape in its
    loading report is a ConfigError naming `key`, as a checkpoint that does
    not fit is."""
    found = {
        "missing": sorted(map(str, report.get("missing_keys") or ())),
        "unexpected": sorted(map(str, report.get("unexpected_keys") or ())),
        "wrong shape": sorted(_mismatch(entry) for entry in report.get("mismatched_keys") or ()),
    }
    problems = [f"{len(names)} {label}: {first_of(names)}" for label, names in found.items() if names]
    if problems:
        raise ConfigError(
            key,
            value,
            "holds weights that do not fit the model transformers built from it (it would start those from "
            "random values): " + "; ".join(problems),
        )


def _mismatch(entry: Any) -> str:
    """A wrongly shaped tensor of a loading report, (name, its shape, the model's), as `check` says one."""
    if isinstance(entry, (tuple, list)) and len(entry) == 3:
        name, shape, expected = entry
        return f"{name} {list(shape)} (the model expects {list(expected)})"
    return str(entry)


__all__ = ["WeightsMismatch", "check_checkpoint", "checkpoint_table", "compare", "read_checkpoint", "unfused_view"]
