"""Load a built package as a drop-in `torch.nn.Module`, after checking it.

Weights are bound in place (`user_managed`): the package reads the caller's
tensors, so no weight is copied on the device and a buffer the graph writes is
the caller's buffer.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..artifact import MANIFEST
from ..config.spec import SINGLE_MODEL, tf32_policy
from ..errors import ArtifactError, WeightsMismatch
from .checkpoint import as_argument, compare, dtype_name, laid_out, read_all, read_checkpoint
from .gpu import check_gpu_arch, fp32_precision, gpu_of
from .manifest import STATE_KWARG, altered_digest, check_contract, manifest_methods, method_bindings, read_manifest

WeightsArg = str | Path | Mapping[str, torch.Tensor] | None


class PackageMethod:
    """One entry point of a loaded package: its model, input checks and call.

    Inputs may be passed by position or by name, like the eager method;
    constant keyword arguments fixed at build time (`use_cache`) are filled in,
    and passing a different value is an error, not a silent no-op. Buffers the
    method mutates are the package's shared `state`: written back after every
    call, so what one method writes the next one reads.
    """

    def __init__(
        self,
        name: str,
        runner: Any,
        entry: Mapping[str, Any],
        device: torch.device,
        tf32: bool | None,
        state: dict[str, torch.Tensor],
    ) -> None:
        self.name, self.runner = name, runner
        self._constant_kwargs = dict(entry.get("kwargs") or {})
        self._kwargs_key = "module.kwargs" if entry["model"] == SINGLE_MODEL else f"module.methods.{name}.kwargs"
        self._positional = [i["name"] for i in entry["inputs"] if i["positional"]]
        self._keyword = [i["name"] for i in entry["inputs"] if not i["positional"]]
        self._order = self._positional + self._keyword
        self._check = InputCheck(entry["inputs"], device, self._kwargs_key.removesuffix(".kwargs"))
        self._direct = DirectCall.of(runner, self._positional, set(self._keyword), set(self._constant_kwargs))
        self._tf32 = tf32
        self._shared_state = state
        self._state_names = list(entry.get("state") or [])
        # Constants the method returns (None, an int): the compiled code gives them back as tensors.
        self._constants = [(i, o["value"]) for i, o in enumerate(entry.get("outputs") or []) if "value" in o]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) > len(self._order):
            order = self._order
            raise TypeError(f"the package takes {len(order)} inputs ({', '.join(order)}), got {len(args)} positional")
        bound = dict(zip(self._order, args, strict=False))
        if kwargs:
            self._bind_keywords(bound, kwargs)
        if len(bound) < len(self._order):
            raise TypeError(f"missing inputs: {', '.join(n for n in self._order if n not in bound)}")
        self._check(bound)
        if self._tf32 is None:
            return self._run(bound)
        with fp32_precision(self._tf32):  # extern kernels (cuBLAS, cuDNN) read it on every call
            return self._run(bound)

    def _bind_keywords(self, bound: dict[str, Any], kwargs: dict[str, Any]) -> None:
        for key, value in kwargs.items():
            if key in self._constant_kwargs:
                if value != self._constant_kwargs[key]:
                    raise ValueError(
                        f"{key}={value!r} differs from the value the package was built with "
                        f"({self._constant_kwargs[key]!r}, {self._kwargs_key}.{key})"
                    )
                continue
            if key in bound or key not in self._order:
                problem = "given twice" if key in bound else "not an input of the package"
                raise TypeError(f"input '{key}' is {problem}; inputs: {', '.join(self._order)}")
            bound[key] = value

    def _run(self, bound: dict[str, torch.Tensor]) -> Any:
        state = {name: self._shared_state[name] for name in self._state_names}
        if self._direct is not None:
            out = self._direct(bound, state)
        else:  # the runner's own call, which flattens the inputs itself
            args = [bound[n] for n in self._positional]
            kwargs = {**{n: bound[n] for n in self._keyword}, **self._constant_kwargs}
            out = self.runner(*args, **kwargs, **({STATE_KWARG: state} if state else {}))
        if state:
            out, new_state = out
            for name, tensor in state.items():
                tensor.copy_(new_state[name])
        if self._constants:
            leaves, spec = pytree.tree_flatten(out)
            for index, value in self._constants:
                leaves[index] = value
            out = pytree.tree_unflatten(leaves, spec)
        return out


class LoadedModule(torch.nn.Module):
    """A compiled package behind the `nn.Module` call interface: `m(...)` runs
    the method that stands for the module's forward, `m.NAME(...)` (or
    `m.methods[NAME](...)`) any method of a package with several. Attributes
    the package lacks are looked up on the host module, when one was given.
    """

    def __init__(
        self,
        runner: Any,
        manifest: dict[str, Any],
        output_dir: Path,
        weights: Mapping[str, torch.Tensor] | None = None,
        host: torch.nn.Module | None = None,
        device: torch.device | None = None,
        state: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """`runner`: the loaded model of each method, by model name (or the
        one model of a single-method package)."""
        super().__init__()
        self.manifest = manifest
        self.output_dir = output_dir
        # Plain attributes, not registered: the host stays the caller's module
        # and the bound tensors stay alive as long as the package does.
        object.__setattr__(self, "_host", host)
        object.__setattr__(self, "bound_weights", dict(weights or {}))
        # Buffers the module mutates: passed in and written back on every call.
        object.__setattr__(self, "state", dict(state or {}))
        self._device = torch.device(device if device is not None else manifest["target"]["device"])
        # Only a float32 CUDA package sets torch's precision flags around its calls.
        tf32 = tf32_policy(str(self._device), manifest["target"]["dtype"], manifest["target"].get("tf32"))
        entries = manifest_methods(manifest)
        runners = runner if isinstance(runner, Mapping) else {entry["model"]: runner for entry in entries.values()}
        methods = {
            name: PackageMethod(name, runners[entry["model"]], entry, self._device, tf32, self.state)
            for name, entry in entries.items()
        }
        object.__setattr__(self, "methods", methods)
        # m(...): the method that runs the module's forward, else the first
        self.default_method = next((n for n, e in entries.items() if e["method"] == "forward"), next(iter(entries)))

    @property
    def host(self) -> torch.nn.Module | None:
        """The eager module this package stands in for, if one was given."""
        return self.__dict__["_host"]

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            methods = self.__dict__.get("methods") or {}
            if name in methods:
                return methods[name]
            host = self.__dict__.get("_host")
            if host is None:
                raise
            return getattr(host, name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.methods[self.default_method](*args, **kwargs)

    def constant_fqns(self, method: str | None = None) -> list[str]:
        """The names a method's model binds (the default method's unless named)."""
        return list(self.methods[method or self.default_method].runner.get_constant_fqns())


class DirectCall:
    """A package's own entry point (`boxed_run`) with its input order and
    output tree read once at load. torch's runner parses both and flattens the
    inputs on every call, which costs more than the call itself for a small
    model (24 of 39 microseconds for the mlp on the CPU)."""

    def __init__(self, loader: Any, order: list[str], out_spec: pytree.TreeSpec) -> None:
        self._run, self._order, self._out_spec = loader.boxed_run, order, out_spec
        self._state_prefix = f"{STATE_KWARG}."

    @classmethod
    def of(cls, runner: Any, positional: list[str], keyword: set[str], constants: set[str]) -> DirectCall | None:
        """The direct call of `runner`, or None when its call spec holds
        anything but the inputs, constant keyword arguments and threaded state."""
        loader = getattr(runner, "loader", None)
        if loader is None or not hasattr(loader, "boxed_run"):
            return None
        in_spec, out_spec = (pytree.treespec_loads(spec) for spec in loader.get_call_spec())
        args, kwargs = pytree.tree_unflatten(list(range(in_spec.num_leaves)), in_spec)
        if len(args) != len(positional):
            return None
        slots = list(zip(args, positional, strict=True))
        for name, leaf in kwargs.items():
            if name == STATE_KWARG and isinstance(leaf, dict):
                slots += [(index, f"{STATE_KWARG}.{buffer}") for buffer, index in leaf.items()]
            elif name in keyword:
                slots.append((leaf, name))
            elif name not in constants:  # constants are no tensors: the package takes none for them
                return None
        if not all(isinstance(index, int) for index, _ in slots):
            return None
        return cls(loader, [name for _, name in sorted(slots)], out_spec)

    def __call__(self, inputs: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor]) -> Any:
        if state:
            inputs = {**inputs, **{self._state_prefix + name: t for name, t in state.items()}}
        return pytree.tree_unflatten(self._run([inputs[name] for name in self._order]), self._out_spec)


class InputCheck:
    """Refuses inputs the package was not built for: a compiled package runs a
    wrong shape silently, reading out of bounds. The rules are read from the
    manifest once; a call only compares."""

    def __init__(self, specs: list[dict[str, Any]], device: torch.device, key: str = "module") -> None:
        self._device_type = device.type
        self._device = device
        self._key = key
        # Declared value ranges (token ids): a value outside one would make the
        # compiled code read out of bounds, which aborts the process.
        self._ranges = [
            (spec["name"], spec.get("low"), spec.get("high"))
            for spec in specs
            if spec.get("low") is not None or spec.get("high") is not None
        ]
        self._rules = [
            (
                spec["name"],
                getattr(torch, spec["dtype"]),
                spec,
                [(axis, size) for axis, size in enumerate(spec["shape"]) if str(axis) not in spec["dynamic"]],
                [(int(axis), d["min"], d["max"], d["name"]) for axis, d in spec["dynamic"].items()],
            )
            for spec in specs
        ]

    def __call__(self, inputs: Mapping[str, Any]) -> None:
        seen: dict[str, tuple[int, str]] = {}
        for name, dtype, spec, static, dynamic in self._rules:
            value = inputs[name]
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"input '{name}' must be a tensor, got {type(value).__name__}")
            if value.dtype != dtype:
                raise TypeError(
                    f"input '{name}' has dtype {dtype_name(value.dtype)}; the package takes {spec['dtype']}"
                )
            if value.device.type != self._device_type:
                raise TypeError(f"input '{name}' is on {value.device}; the package runs on {self._device}")
            shape = value.shape
            if len(shape) != len(spec["shape"]):
                raise ValueError(
                    f"input '{name}' has {len(shape)} dims {list(shape)}; expected {len(spec['shape'])} "
                    f"like {spec['shape']}"
                )
            for axis, size in static:
                if shape[axis] != size:
                    raise ValueError(
                        f"input '{name}' has size {shape[axis]} on axis {axis}; the package was built for {size} "
                        f"(the axis is static; make it dynamic in module.inputs.{name}.dynamic)"
                    )
            for axis, low, high, dim in dynamic:
                size = shape[axis]
                if not low <= size <= high:
                    raise ValueError(
                        f"input '{name}' has size {size} on axis {axis} ('{dim}'); the package accepts {low} to {high}"
                    )
                first = seen.setdefault(dim, (size, name))
                if first[0] != size:
                    raise ValueError(
                        f"inputs '{first[1]}' and '{name}' share dim '{dim}' but have sizes {first[0]} and {size}"
                    )
        for name, low, high in self._ranges:
            self._check_range(name, inputs[name], low, high)

    def _check_range(self, name: str, value: torch.Tensor, low: int | None, high: int | None) -> None:
        if not value.numel():
            return
        smallest, largest = (int(v) for v in torch.aminmax(value))  # one pass, one sync on a GPU
        if (low is not None and smallest < low) or (high is not None and largest >= high):
            accepted = f"{'-inf' if low is None else low} to {'inf' if high is None else high - 1}"
            raise ValueError(
                f"input '{name}' holds values from {smallest} to {largest}; the package accepts {accepted} "
                f"({self._key}.inputs.{name}.low/high): a value outside would make its code read out of bounds"
            )


def check_file(output_dir: Path, section: Mapping[str, Any], what: str) -> Path:
    """The path of a file the manifest lists, once its sha256 matches."""
    path = output_dir / section["file"]
    if not path.is_file():
        raise ArtifactError(f"{path} is missing")
    digest = altered_digest(path, section)
    if digest is not None:
        raise ArtifactError(
            f"{path} ({what}) was altered after its build: sha256 {digest} differs from the manifest's "
            f"{section['sha256']}; refusing to load it"
        )
    return path


def open_package(
    output_dir: Path,
    manifest: dict[str, Any],
    weights: WeightsArg = None,
    device: str | torch.device | None = None,
    host: torch.nn.Module | None = None,
) -> LoadedModule:
    """Load a package whose manifest is already read (build uses it before publishing)."""
    package = check_file(output_dir, manifest["package"], "the package")
    check_contract(package, manifest, output_dir / MANIFEST)
    device = torch.device(device if device is not None else manifest["target"]["device"])
    check_gpu_arch(manifest["toolchain"].get("gpu"), device, gpu_of(str(device)))
    external = manifest["weights"]["mode"] == "external"
    # Checked when read: bound to a host's or the caller's tensors, a 2 GB sidecar
    # is never hashed (1.7 s of a 1.8 s load on the H200).
    sidecar = functools.partial(check_file, output_dir, manifest["weights"], "the weights") if external else None

    entries = manifest["weights"]["tensors"]
    source, tensors = _weights_source(weights, host, sidecar, device)
    borrowed = isinstance(weights, Mapping) or (weights is None and host is not None)
    bound: dict[str, torch.Tensor] = {}
    if tensors is not None:
        threaded = {t["fqn"] for t in (manifest.get("state") or {}).get("tensors", [])}
        tensors = {name: t for name, t in tensors.items() if name not in threaded}  # bound as state, below
        table = {name: (list(t.shape), dtype_name(t.dtype)) for name, t in tensors.items()}
        devices = {name: t.device for name, t in tensors.items()}
        # The caller's tensors are bound as they are (borrowed), so their layout must be the package's.
        strides = {name: t.stride() for name, t in tensors.items()} if borrowed else None
        chosen, problems = compare(entries, table, device, devices, manifest["weights"].get("unused", []), strides)
        if problems:
            raise WeightsMismatch(problems, source)
        by_fqn = {e["fqn"]: e for e in entries}
        bound = {fqn: laid_out(tensors[name], by_fqn[fqn]) for fqn, name in chosen.items()}
        if external and len(bound) < len(entries):
            # constants of the forward's code, non-persistent buffers: the build's values
            defaults = read_checkpoint(sidecar(), device)
            bound.update({e["fqn"]: laid_out(defaults[e["fqn"]], e) for e in entries if e["fqn"] not in bound})

    state = _state_source(output_dir, manifest, weights if isinstance(weights, Mapping) else None, host, device)
    index = device.index if device.type == "cuda" and device.index is not None else -1
    runners = {}
    for name, entry in manifest_methods(manifest).items():
        runner = load_package(package, index, entry["model"])
        _import_tree_types(runner)
        # Each method binds the same tensors by its own names: one copy for all.
        names = method_bindings(entries, name)
        own = {fqn: bound[key] for fqn, key in names.items() if key in bound}
        if own:
            runner.load_constants(own, check_full_update=external, user_managed=True)
        runners[entry["model"]] = runner
    return LoadedModule(runners, manifest, output_dir, bound, host, device, state)


def _import_tree_types(runner: Any) -> None:
    """Import the modules defining the types a package's call spec names (a
    transformers ModelOutput, whatever class `from_pretrained` returned):
    pytree must know them to rebuild the output tree, and they register
    themselves when imported."""
    loader = getattr(runner, "loader", None)
    if loader is None:
        return
    for spec in loader.get_call_spec():
        for type_name in re.findall(r'"type":\s*"([A-Za-z_][\w.]*)"', spec):
            module_path = type_name.rpartition(".")[0]
            if module_path and module_path not in sys.modules:
                with contextlib.suppress(Exception):
                    importlib.import_module(module_path)


def _state_source(
    output_dir: Path,
    manifest: dict[str, Any],
    weights: Mapping[str, torch.Tensor] | None,
    host: torch.nn.Module | None,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """The mutated buffers a stateful package threads: the host's own buffers
    (so the caller sees them change), a mapping's, or the build's initial values."""
    section = manifest.get("state")
    if not section:
        return {}
    names = [t["fqn"] for t in section["tensors"]]
    if host is not None:
        return {name: host.get_buffer(name) for name in names}
    if weights is not None and all(name in weights for name in names):
        return {name: weights[name] for name in names}
    initial = read_checkpoint(check_file(output_dir, section, "the state"), device)
    return {name: initial[name] for name in names}


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
        named = dict(host.named_parameters(remove_duplicate=False))
        named.update(host.named_buffers(remove_duplicate=False))
        return f"host module {type(host).__name__}", {k: v.detach() for k, v in named.items()}
    if sidecar is not None:
        path = sidecar()
        return str(path), read_checkpoint(path, device)
    return "the package", None


def load_package(path: Path, device_index: int = -1, model: str = SINGLE_MODEL) -> Any:
    """Load one model of a `.pt2` package into this process (torch's AOTICompiledModel)."""
    if model == SINGLE_MODEL:
        return torch._inductor.aoti_load_package(str(path), device_index=device_index)
    # This model only: torch's load_package(path, name) loads every model of the archive to return one.
    from torch._inductor.package.package import AOTICompiledModel

    return AOTICompiledModel(torch._C._aoti.AOTIModelPackageLoader(str(path), model, False, 1, device_index))


def load(
    output_dir: str | Path,
    weights: WeightsArg = None,
    device: str | torch.device | None = None,
    host: torch.nn.Module | None = None,
) -> LoadedModule:
    """Load the package in `output_dir` as a `torch.nn.Module`.

    Checks the package's sha256 against the manifest before any of its code is
    loaded, and the sidecar's before any of it is read. `weights`: None binds the sidecar of an external
    build (or keeps baked weights); a path to a checkpoint, or a mapping such as
    a `state_dict`, is checked by name, shape, dtype and device against the
    manifest and bound in place. `host`: the eager module the package stands in
    for; its attributes stay reachable, and with `weights=None` its own
    parameters and buffers are bound. `device`: defaults to the build's target.
    """
    output_dir = Path(output_dir)
    return open_package(output_dir, read_manifest(output_dir), weights, device, host)
