"""Load a built package as a drop-in `torch.nn.Module`, after checking it.

Weights are bound in place (`user_managed`): the package reads the caller's
tensors, so no weight is copied on the device and a buffer the graph writes is
the caller's buffer. Each method's calls go through `call.PackageMethod`.
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

from ..artifact import MANIFEST, SINGLE_MODEL, default_method, tf32_policy
from ..errors import ArtifactError, WeightsMismatch
from .call import PackageMethod
from .checkpoint import as_argument, compare, laid_out, read_all, read_checkpoint
from .contract import check_contract
from .dtypes import dtype_name
from .gpu import check_gpu_arch, gpu_of
from .hashing import altered_digest
from .manifest import manifest_methods, method_bindings, read_manifest

WeightsArg = str | Path | Mapping[str, torch.Tensor] | None


class LoadedModule(torch.nn.Module):
    """A compiled package behind the `nn.Module` call interface: `m(...)` runs
    the method that stands for the module's forward, `m.NAME(...)` (or
    `m.methods[NAME](...)`) any method of a package with several. Attributes
    the package lacks are looked up on the host module, when one was given.
    """

    # Set per instance (declared here so `attribute_names` sees them).
    manifest: dict[str, Any]
    output_dir: Path
    bound_weights: dict[str, torch.Tensor]
    state: dict[str, torch.Tensor]
    methods: dict[str, PackageMethod]
    default_method: str
    _host: torch.nn.Module | None
    _device: torch.device

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
        self.default_method = default_method({name: entry["method"] for name, entry in entries.items()})

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


def attribute_names() -> frozenset[str]:
    """Every name a loaded package answers to by itself (its own attributes,
    nn.Module's, those set per instance): a method of a package named like
    one would be shadowed by it, so the build refuses such names."""
    probe = object.__new__(LoadedModule)
    torch.nn.Module.__init__(probe)
    return frozenset(dir(LoadedModule)) | frozenset(vars(probe)) | frozenset(LoadedModule.__annotations__)


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
