"""Load a built package as a drop-in `torch.nn.Module`, after checking it.

Weights are bound in place (`user_managed`, `binding.py`): the package reads
the caller's tensors, so no weight is copied on the device and a buffer the
graph writes is the caller's buffer. Each method's calls go through
`call.PackageMethod`, one at a time (one lock per loaded package), and on a
GPU may replay CUDA graphs (`graphs.py`).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..artifact import MANIFEST, default_method, tf32_policy
from ..errors import quiet_known_warnings
from .binding import WeightsArg, bind, initial_state, lazy_sidecar, state_to_bind, weights_to_bind
from .call import PackageMethod
from .contract import check_contract
from .gpu import check_device, check_gpu_arch, gpu_of
from .graphs import GraphCache
from .hashing import check_file, check_served_files
from .manifest import causal_lm_sizes, manifest_methods, read_manifest, state_mode
from .runner import import_tree_types, load_libraries, load_package
from .threads import check_threads

DEFAULT_MAX_GRAPHS = 8
quiet_known_warnings()  # torch's "No CUDA runtime is found" on every CPU load: not the user's to act on


class LoadedModule(torch.nn.Module):
    """A compiled package behind the `nn.Module` call interface: `m(...)` runs
    the method that stands for the module's forward, `m.NAME(...)` (or
    `m.methods[NAME](...)`) any method of a package with several. Attributes
    the package lacks are looked up on the host module, when one was given.

    Thread-safe by serializing: calls from several threads run one at a time
    (the methods share one state, and a runner that replays CUDA graphs is
    single-threaded).
    """

    # Set per instance (declared here so `attribute_names` sees them).
    manifest: dict[str, Any]
    output_dir: Path
    bound_weights: dict[str, torch.Tensor]
    state: dict[str, torch.Tensor]
    methods: dict[str, PackageMethod]
    runners: dict[str, Any]
    default_method: str
    cuda_graphs: bool
    _host: torch.nn.Module | None
    _device: torch.device
    _lock: threading.Lock

    def __init__(
        self,
        runner: Any,
        manifest: dict[str, Any],
        output_dir: Path,
        weights: Mapping[str, torch.Tensor] | None = None,
        host: torch.nn.Module | None = None,
        device: torch.device | None = None,
        state: Mapping[str, torch.Tensor] | None = None,
        graphs: tuple[int, bool] | None = None,
        threads: int | None = None,
    ) -> None:
        """`runner`: the loaded model of each method, by model name (or the
        one model of a single-method package). `graphs`: (max graphs per
        method, copy outputs) to replay CUDA graphs, None to call plainly."""
        super().__init__()
        self.manifest = manifest
        self.output_dir = output_dir
        # Plain attributes, not registered: the host stays the caller's module
        # and the bound tensors stay alive as long as the package does.
        object.__setattr__(self, "_host", host)
        object.__setattr__(self, "bound_weights", dict(weights or {}))
        # Buffers the methods mutate, shared by all: written in place by the
        # compiled code, or (threaded) passed in and written back on every call.
        object.__setattr__(self, "state", dict(state or {}))
        object.__setattr__(self, "_lock", threading.Lock())
        self._device = torch.device(device if device is not None else manifest["target"]["device"])
        self.cuda_graphs = graphs is not None
        # Only a float32 CUDA package sets torch's precision flags around its calls.
        tf32 = tf32_policy(str(self._device), manifest["target"]["dtype"], manifest["target"].get("tf32"))
        entries = manifest_methods(manifest)
        runners = runner if isinstance(runner, Mapping) else {entry["model"]: runner for entry in entries.values()}
        object.__setattr__(self, "runners", dict(runners))
        threaded = self.state if state_mode(manifest) == "threaded" else {}
        methods = {
            name: PackageMethod(
                name,
                runners[entry["model"]],
                entry,
                self._device,
                tf32,
                threaded,
                self._lock,
                GraphCache(name, graphs[0], graphs[1]) if graphs is not None else None,
                threads,
                causal_lm_sizes(manifest, entry["inputs"]),  # module.max_cache_len, not the position's key
            )
            for name, entry in entries.items()
        }
        object.__setattr__(self, "methods", methods)
        # m(...): the method that runs the module's forward, else the first
        self.default_method = default_method({name: entry["method"] for name, entry in entries.items()})

    @property
    def device(self) -> torch.device:
        """Where the package runs (and its inputs must be)."""
        return self._device

    @property
    def threads(self) -> int | None:
        """The CPU threads each call runs on (None: as this process is set)."""
        return next(iter(self.methods.values())).threads

    @threads.setter
    def threads(self, threads: int | None) -> None:
        for method in self.methods.values():
            method.threads = check_threads(threads)

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

    def __repr__(self) -> str:
        """Its methods with their inputs (dynamic dims by name and range), and where it was loaded from."""
        lines = [f"{name}({signature(entry)})" for name, entry in manifest_methods(self.manifest).items()]
        graphs = ", cuda_graphs" if self.cuda_graphs else ""
        return (
            f"LoadedModule({self.manifest['name']!r} from {str(self.output_dir)!r}, on {self._device}{graphs},\n"
            + "".join(f"  {line}\n" for line in lines)
            + ")"
        )

    def constant_fqns(self, method: str | None = None) -> list[str]:
        """The names a method's model binds (the default method's unless named)."""
        return list(self.methods[method or self.default_method].runner.get_constant_fqns())

    def bind(self, weights: WeightsArg) -> None:
        """Bind other weights (a checkpoint path or a mapping), checked like
        `load`'s. Every method's captured CUDA graphs are dropped: they hold
        the addresses of the tensors bound before."""
        sidecar = lazy_sidecar(self.output_dir, self.manifest)  # the forward's constants a checkpoint lacks
        bound = weights_to_bind(self.manifest, weights, None, sidecar, self._device)
        with self._lock:
            bind(self.runners, self.manifest, bound, self.state)
            object.__setattr__(self, "bound_weights", bound)
            for method in self.methods.values():
                method.drop_graphs()

    def reset_state(self) -> None:
        """Write the build's initial values into the state (an empty KV cache),
        in place: the tensors stay the ones bound, so captured graphs stay valid."""
        section = self.manifest.get("state")
        if not section:
            return
        initial = initial_state(self.output_dir, self.manifest, self._device)
        with self._lock, torch.no_grad():
            for name, tensor in self.state.items():
                tensor.copy_(initial[name])


def signature(entry: Mapping[str, Any]) -> str:
    """A method's inputs as a call reads them: `x: float32[batch 1..64, 16]`."""
    parts = []
    for spec in entry["inputs"]:
        dims = [
            f"{d['name']} {d['min']}..{d['max']}" if (d := spec["dynamic"].get(str(axis))) else str(size)
            for axis, size in enumerate(spec["shape"])
        ]
        parts.append(f"{spec['name']}: {spec['dtype']}[{', '.join(dims)}]")
    return ", ".join(parts)


def attribute_names() -> frozenset[str]:
    """Every name a loaded package answers to by itself (its own attributes,
    nn.Module's, those set per instance): a method of a package named like
    one would be shadowed by it, so the build refuses such names."""
    probe = object.__new__(LoadedModule)
    torch.nn.Module.__init__(probe)
    return frozenset(dir(LoadedModule)) | frozenset(vars(probe)) | frozenset(LoadedModule.__annotations__)


def open_package(
    output_dir: Path,
    manifest: dict[str, Any],
    weights: WeightsArg = None,
    device: str | torch.device | None = None,
    host: torch.nn.Module | None = None,
    graphs: tuple[int, bool] | None = None,
    threads: int | None = None,
) -> LoadedModule:
    """Load a package whose manifest is already read (build uses it before publishing)."""
    package = check_file(output_dir, manifest["package"], "the package")
    check_contract(package, manifest, output_dir / MANIFEST)
    check_served_files(output_dir, manifest)
    device = torch.device(device if device is not None else manifest["target"]["device"])
    check_gpu_arch(manifest["toolchain"].get("gpu"), device, gpu_of(str(device)))
    bound = weights_to_bind(manifest, weights, host, lazy_sidecar(output_dir, manifest), device)
    mapping = weights if isinstance(weights, Mapping) else None
    state = state_to_bind(lambda: initial_state(output_dir, manifest, device), manifest, mapping, host, device)
    index = device.index if device.type == "cuda" and device.index is not None else -1
    load_libraries(manifest)
    runners = {}
    for entry in manifest_methods(manifest).values():
        runners[entry["model"]] = runner = load_package(package, index, entry["model"], graphs is not None)
        import_tree_types(runner)
    bind(runners, manifest, bound, state)
    return LoadedModule(runners, manifest, output_dir, bound, host, device, state, graphs, check_threads(threads))


def graph_options(
    manifest: dict[str, Any],
    device: torch.device,
    cuda_graphs: bool | None,
    max_graphs: int | None,
    copy_outputs: bool,
) -> tuple[int, bool] | None:
    """(max graphs per method, copy outputs) when calls replay CUDA graphs, else None.
    Unset arguments take the build's `serve` section; graphs need a CUDA device."""
    serve = manifest.get("serve") or {}
    if cuda_graphs is None:
        cuda_graphs = bool(serve.get("cuda_graphs")) and device.type == "cuda"
    if not cuda_graphs:
        return None
    if device.type != "cuda":
        raise ValueError(f"cuda_graphs=True needs a CUDA device; this package runs on {device}")
    bound = serve.get("max_graphs", DEFAULT_MAX_GRAPHS) if max_graphs is None else max_graphs
    if bound < 0:
        raise ValueError(f"max_graphs must be >= 0, got {bound}")
    return bound, copy_outputs


def load(
    output_dir: str | Path,
    weights: WeightsArg = None,
    device: str | torch.device | None = None,
    host: torch.nn.Module | None = None,
    *,
    cuda_graphs: bool | None = None,
    max_graphs: int | None = None,
    copy_outputs: bool = True,
    threads: int | None = None,
) -> LoadedModule:
    """Load the package in `output_dir` as a `torch.nn.Module`.

    Checks the package's sha256 against the manifest before any of its code is
    loaded, the sidecar's before any of it is read, and those of the files
    served beside it (a tokenizer, `check_served_files`). `weights`: None binds the sidecar of an external
    build (or keeps baked weights); a path to a checkpoint, or a mapping such as
    a `state_dict`, is checked by name, shape, dtype and device against the
    manifest and bound in place. `host`: the eager module the package stands in
    for; its attributes stay reachable, and with `weights=None` its own
    parameters and buffers are bound. `device`: defaults to the build's target;
    one the package cannot run on (another device type than the build's
    target, no usable CUDA device, an index past this machine's) is a
    ConfigError naming the argument, before any weight is read.

    `cuda_graphs`: replay each method from a CUDA graph per input shape (the
    first call of a shape warms up, the second captures), at most `max_graphs`
    shapes per method; unset, the build's `serve.cuda_graphs` and
    `serve.max_graphs` decide (on a CUDA device). Outputs are copies the next
    call leaves alone; `copy_outputs=False` returns the graph's own tensors,
    which the next call of that shape overwrites.

    `threads`: the CPU threads each call runs on (torch's and OpenMP's count,
    set around the call and put back after); None leaves this process's
    setting. On a busy machine fewer than its cores keeps a CPU package from
    fighting other work for them. At most 4 times the cores this process may
    run on (`threads.max_threads`): more only wait; a ValueError names it.
    """
    if host is not None and not isinstance(host, torch.nn.Module):
        raise TypeError(f"host: expected the eager nn.Module the package stands in for, got {type(host).__name__}")
    output_dir = Path(output_dir)
    manifest = read_manifest(output_dir)
    target = check_device(device, manifest["target"]["device"])  # before any weight is read there
    graphs = graph_options(manifest, target, cuda_graphs, max_graphs, copy_outputs)
    return open_package(output_dir, manifest, weights, target, host, graphs, threads)
