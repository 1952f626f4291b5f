"""What a loaded package binds: its weights (the sidecar, a checkpoint, the
caller's tensors or a host module's), checked by name, shape, dtype, device
and layout before anything is bound, and its state (the buffers its methods
write). Bound `user_managed`: the package reads and writes the given tensors
themselves, so nothing is copied on the device and every method of a package
binds one copy."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import WeightsMismatch
from .checkpoint import compare, config_differences, laid_out, unfused_view
from .dtypes import dtype_name
from .hashing import check_file
from .manifest import fused_tensors, manifest_methods, method_bindings, quantized_originals, state_mode
from .reader import as_argument, read_all, read_checkpoint

WeightsArg = str | Path | Mapping[str, torch.Tensor] | None


log = logging.getLogger("flashrt_build")


def _quantized_hint(manifest: dict[str, Any], problems: dict[str, list[str]]) -> str:
    """What to do when float weights meet a quantized package."""
    quant = manifest.get("quant")
    originals = quantized_originals(manifest["weights"]["tensors"])
    if not quant or not set(originals) & set(problems.get("unexpected", [])):
        return ""
    return (
        f". The package's weights are quantized (quant={quant['name']}): it binds their parts, not float weights. "
        f"Build with module.checkpoint=THAT_FILE and quant={quant['name']}: the checkpoint is quantized by the "
        "recipe and the compiled package reused (external weights), nothing recompiled"
    )


def fused_at_load(manifest: dict[str, Any], tensors: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """Weights named as the checkpoint names them, for a package whose
    projections were fused (`passes`): each fused tensor made from its parts,
    row for row, as the manifest maps them (a copy; the parts are dropped)."""
    made = 0
    shapes = {entry["fqn"]: entry["shape"] for entry in manifest["weights"]["tensors"]}
    for name, parts in fused_tensors(manifest):
        names = [part for part, _ in parts]
        if name in tensors or not all(part in tensors for part in names):
            continue  # named as the package binds it already, or not this checkpoint's: compare() says
        _check_parts(name, parts, shapes.get(name), tensors, source)
        if not made:
            tensors = dict(tensors)  # the caller's mapping stays as given
        tensors[name] = torch.cat([tensors.pop(part) for part in names])
        made += 1
    if made:
        log.info("fused %d tensors of %s at load, as the build's passes did (a copy)", made, source)
    return tensors


def _check_parts(
    name: str,
    parts: list[tuple[str, list[int]]],
    fused_shape: list[int] | None,
    tensors: Mapping[str, torch.Tensor],
    source: str,
) -> None:
    """Each part of a fused tensor has the rows the manifest maps to it and
    the fused tensor's other sizes, named as `check` names it (torch.cat would
    fail on the columns without naming the tensor, or fuse wrong rows)."""
    if fused_shape is None:
        return  # not a tensor the package binds by this name (quantized parts): compare() says
    wrong = []
    for part, (start, end) in parts:
        expected = [end - start, *fused_shape[1:]]
        if list(tensors[part].shape) != expected:
            wrong.append(f"{part} {list(tensors[part].shape)} (package expects {expected}, rows of {name})")
    if wrong:
        raise WeightsMismatch({"wrong shape": wrong}, source)


def weights_to_bind(
    manifest: dict[str, Any],
    weights: WeightsArg,
    host: torch.nn.Module | None,
    sidecar: Callable[[], Path] | None,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """The tensors to bind by FQN, checked against the manifest; empty keeps
    the baked ones. Raises WeightsMismatch listing every problem."""
    entries = manifest["weights"]["tensors"]
    source, tensors = _weights_source(weights, host, sidecar, device)
    if tensors is None:
        return {}
    borrowed = isinstance(weights, Mapping) or (weights is None and host is not None)
    stateful = {t["fqn"] for t in (manifest.get("state") or {}).get("tensors", [])}
    tensors = {name: t for name, t in tensors.items() if name not in stateful}  # bound as state
    tensors = fused_at_load(manifest, tensors, source)
    table = {name: (list(t.shape), dtype_name(t.dtype)) for name, t in tensors.items()}
    devices = {name: t.device for name, t in tensors.items()}
    # The caller's tensors are bound as they are (borrowed), so their layout must be the package's.
    strides = {name: t.stride() for name, t in tensors.items()} if borrowed else None
    unused = manifest["weights"].get("unused", [])
    chosen, problems = compare(entries, table, device, devices, unused, strides)
    if isinstance(weights, (str, Path)) and Path(weights).is_dir():  # the same tensors of another model are not it
        differing = config_differences(manifest, Path(weights))
        if differing:
            problems["another config.json"] = differing
    if problems:
        # a fused tensor some of whose parts were given: the part not given is named, as `check` names it
        _, seen_unfused = compare(unfused_view(entries, manifest, table), table, device, devices, unused, strides)
        problems = seen_unfused or problems
        raise WeightsMismatch(problems, source, _quantized_hint(manifest, problems))
    by_fqn = {e["fqn"]: e for e in entries}
    bound = {fqn: laid_out(tensors[name], by_fqn[fqn]) for fqn, name in chosen.items()}
    if sidecar is not None and len(bound) < len(entries):
        # constants of the forward's code, non-persistent buffers: the build's values
        defaults = read_checkpoint(sidecar(), device)
        bound.update({e["fqn"]: laid_out(defaults[e["fqn"]], e) for e in entries if e["fqn"] not in bound})
    return bound


def bind(
    runners: Mapping[str, Any],
    manifest: dict[str, Any],
    bound: Mapping[str, torch.Tensor],
    state: Mapping[str, torch.Tensor],
) -> None:
    """Bind `bound` into each method's model by the names it binds them by,
    and the state its code writes in place: the same tensors for all."""
    external = manifest["weights"]["mode"] == "external"
    in_place = state_mode(manifest) == "in_place"
    for name, entry in manifest_methods(manifest).items():
        runner = runners[entry["model"]]
        names = method_bindings(manifest["weights"]["tensors"], name)
        own = {fqn: bound[key] for fqn, key in names.items() if key in bound}
        if in_place:
            own.update({fqn: state[fqn] for fqn in runner.get_constant_fqns() if fqn in state})
        if own:
            runner.load_constants(own, check_full_update=external, user_managed=True)


def state_to_bind(
    initial: Callable[[], dict[str, torch.Tensor]],
    manifest: dict[str, Any],
    weights: Mapping[str, torch.Tensor] | None,
    host: torch.nn.Module | None,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """The buffers the methods write: the host's own (so the caller sees them
    change), a mapping's, or copies of the build's initial values (`initial()`)."""
    section = manifest.get("state")
    if not section:
        return {}
    names = [t["fqn"] for t in section["tensors"]]
    if host is not None:
        state = {name: host.get_buffer(name) for name in names}
    elif weights is not None and all(name in weights for name in names):
        state = {name: weights[name] for name in names}
    else:
        values = initial()
        state = {name: values[name] for name in names}
    if state_mode(manifest) == "in_place":
        check_state(state, manifest, device)
    return state


def check_state(state: Mapping[str, torch.Tensor], manifest: dict[str, Any], device: torch.device) -> None:
    """State the package writes in place must be exactly what its code writes:
    a tensor of another shape, dtype, device or layout would be written out of
    bounds or not at all."""
    problems = []
    for entry in manifest["state"]["tensors"]:
        t = state[entry["fqn"]]
        if list(t.shape) != entry["shape"] or dtype_name(t.dtype) != entry["dtype"] or t.device.type != device.type:
            problems.append(
                f"{entry['fqn']} {list(t.shape)} {dtype_name(t.dtype)} on {t.device} "
                f"(package expects {entry['shape']} {entry['dtype']} on {device})"
            )
        elif not t.is_contiguous():
            problems.append(f"{entry['fqn']} is not contiguous (the package writes it row-major)")
    if problems:
        raise WeightsMismatch({"wrong state": problems}, "the state")


def lazy_sidecar(output_dir: Path, manifest: dict[str, Any]) -> Callable[[], Path] | None:
    """An external build's sidecar, its digest checked when it is first read:
    bound to a host's or the caller's tensors, a 2 GB sidecar is never hashed
    (1.7 s of a 1.8 s load on the H200). None for baked weights."""
    if manifest["weights"]["mode"] != "external":
        return None
    return functools.partial(check_file, output_dir, manifest["weights"], "the weights")


def initial_state(output_dir: Path, manifest: dict[str, Any], device: torch.device) -> dict[str, torch.Tensor]:
    """The build's initial values of the state (state.safetensors, its digest checked)."""
    return read_checkpoint(check_file(output_dir, manifest["state"], "the state"), device)


def _weights_source(
    weights: WeightsArg, host: torch.nn.Module | None, sidecar: Callable[[], Path] | None, device: torch.device
) -> tuple[str, Mapping[str, torch.Tensor] | None]:
    """(description, name -> tensor) of the weights to bind; None keeps the baked ones."""
    if weights is not None and not isinstance(weights, (str, Path, Mapping)):
        raise TypeError(f"weights must be a path, a mapping of names to tensors or None, not {type(weights).__name__}")
    if isinstance(weights, (str, Path)):  # a file, or a directory as save_pretrained writes one
        return str(weights), read_all(as_argument("weights", weights), device, "weights")
    if isinstance(weights, Mapping):
        return "the given mapping", weights
    if host is not None:
        named: dict[str, torch.Tensor] = dict(host.named_parameters(remove_duplicate=False))
        named.update(host.named_buffers(remove_duplicate=False))
        return f"host module {type(host).__name__}", {k: v.detach() for k, v in named.items()}
    if sidecar is not None:
        path = sidecar()
        return str(path), read_checkpoint(path, device)
    return "the package", None
