"""The pipeline: config -> spec -> module -> inputs -> exported -> package ->
verified -> published. Each stage is one function from the previous value."""

from __future__ import annotations

import hashlib
import inspect
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from . import __version__
from .errors import ConfigError
from .export import export_module
from .inputs import dynamic_shapes, make_inputs, probe_sizes
from .manifest import MANIFEST, PACKAGE, SCHEMA, canonical_json, config_sha256, file_sha256, write_manifest
from .module import import_target, instantiate_module
from .package import compile_package, load_package, validate_inductor_options
from .progress import StageTimer
from .publish import publish, staging_dir
from .schema import BuildConfig
from .spec import BuildSpec, resolve_spec
from .toolchain import describe_toolchain
from .verify import verify_package
from .weights import match_package_tensors

log = logging.getLogger("flashrt_build")

# Config keys that say where and whether to build, not what is built.
COSMETIC_KEYS = ("output_root", "output_dir", "variant", "verify")


@dataclass
class BuildResult:
    """What `build` produced: where, the manifest, and whether work was done."""

    output_dir: Path
    manifest: dict[str, Any]
    status: str  # "built"

    @property
    def package(self) -> Path:
        return self.output_dir / PACKAGE


def as_build_config(cfg: DictConfig | BuildConfig | Mapping[str, Any]) -> DictConfig:
    """Merge any config-like value over the schema, so API callers get the
    same validation as the CLI."""
    schema = OmegaConf.structured(BuildConfig)
    try:
        merged = OmegaConf.merge(schema, cfg)
    except Exception as exc:
        raise ConfigError(getattr(exc, "full_key", "config"), "?", str(exc).splitlines()[0]) from None
    assert isinstance(merged, DictConfig)
    return merged


def build(cfg: DictConfig | BuildConfig | Mapping[str, Any], cwd: Path | None = None) -> BuildResult:
    """Build one package from a config and publish it to its output directory."""
    spec = resolve_spec(as_build_config(cfg), cwd)
    options = validate_inductor_options(spec.inductor_options)
    _check_device(spec.device)
    timer = StageTimer(spec.name)
    log.info(
        "building %s <%s> for %s/%s, weights %s -> %s",
        spec.name,
        spec.target,
        spec.device,
        spec.dtype,
        spec.weights.value,
        spec.output_dir,
    )

    with timer.stage("instantiate"):
        module = instantiate_module(spec)
        timer.notes["instantiate"] = f"{sum(p.numel() for p in module.parameters()):,} parameters"
    with timer.stage("export"):
        example = make_inputs(spec)
        program = export_module(module, spec, example, dynamic_shapes(spec, example))
        timer.notes["export"] = f"{len(program.graph.nodes)} graph nodes"

    with staging_dir(spec.output_dir) as staging:
        with timer.stage("compile"):
            package_path = compile_package(program, options, staging / PACKAGE, spec.target)
        with timer.stage("package"):
            runner = load_package(package_path)
            tensors, inlined = match_package_tensors(program, runner.get_constant_fqns(), spec.target)
            package_bytes = package_path.stat().st_size
            timer.notes["package"] = f"{package_bytes / 1e6:.2f} MB, {len(tensors)} tensors bound"
            if inlined:
                timer.notes["package"] += (
                    f", {len(inlined)} code constants inlined ({', '.join(t.source for t in inlined)})"
                )
        verification: dict[str, Any] = {"passed": None, "enabled": False}
        if spec.verify:
            with timer.stage("verify"):
                probes = [
                    (sizes, make_inputs(spec, seed=spec.seed + 1 + i, sizes=sizes))
                    for i, sizes in enumerate(probe_sizes(spec))
                ]
                results = verify_package(runner, module, probes, spec.atol, spec.rtol)
                verification = _verification(results, spec)
                timer.notes["verify"] = f"{len(results)} probes passed"
        with timer.stage("manifest"):
            toolchain = describe_toolchain(spec.device, options)
            manifest = {
                "schema": SCHEMA,
                "name": spec.name,
                "flashrt_build": __version__,
                "module": _module_provenance(spec),
                "package": {"file": PACKAGE, "sha256": file_sha256(package_path), "bytes": package_bytes},
                "weights": {
                    "mode": spec.weights.value,
                    "file": None,
                    "sha256": None,
                    "tensors": [t.to_json() for t in tensors],
                    # constants of the forward's code that Inductor compiled in
                    "inlined": [t.to_json() for t in inlined],
                },
                "inputs": [inp.to_json() for inp in spec.inputs],
                "outputs": _output_specs(program, spec),
                "target": {"device": spec.device, "dtype": spec.dtype},
                "inductor": {"options": _jsonable(options)},
                "release": spec.release,
                "config": spec.config,
                "config_sha256": config_sha256(spec.config),
                "build_key": None,
                "toolchain": toolchain,
                "verification": verification,
                "timings": timer.timings,
            }
            manifest["build_key"] = build_key(manifest)
            write_manifest(staging, manifest)
        manifest["timings"] = timer.timings  # the manifest stage's own time, for the caller
        publish(staging, spec.output_dir)
    log.info("artifact: %s", spec.output_dir)
    return BuildResult(spec.output_dir, manifest, "built")


def build_key(manifest: Mapping[str, Any]) -> str:
    """Hash of everything that determines the package bytes."""
    config = {k: v for k, v in manifest["config"].items() if k not in COSMETIC_KEYS}
    toolchain = {k: v for k, v in manifest["toolchain"].items() if k not in ("executable", "platform")}
    ingredients = {
        "config": config,
        "module": manifest["module"],
        "toolchain": toolchain,
        "flashrt_build": manifest["flashrt_build"],
    }
    return hashlib.sha256(canonical_json(ingredients).encode()).hexdigest()


def _check_device(device: str) -> None:
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("target.device", device, "no CUDA device is available on this machine (use target=cpu)")


def _module_provenance(spec: BuildSpec) -> dict[str, Any]:
    """The target's dotted path, its source file digest and its distribution."""
    obj = import_target(spec.target)
    try:
        source = inspect.getsourcefile(obj)  # type: ignore[arg-type]
    except TypeError:
        source = None
    top = spec.target.split(".")[0]
    dists = metadata.packages_distributions().get(top, [])
    dist = {"name": dists[0], "version": metadata.version(dists[0])} if dists else None
    checkpoint = None
    if spec.checkpoint is not None:
        checkpoint = {"path": str(spec.checkpoint), "sha256": file_sha256(spec.checkpoint)}
    return {
        "target": spec.target,
        "source_file": source,
        "source_sha256": file_sha256(Path(source)) if source else None,
        "distribution": dist,
        "checkpoint": checkpoint,
        "seed": spec.seed,
    }


def _verification(probes: list[Any], spec: BuildSpec) -> dict[str, Any]:
    """Per output leaf, the worst errors over all probes."""
    worst: dict[str, dict[str, float]] = {}
    for probe in probes:
        for leaf in probe.leaves:
            w = worst.setdefault(leaf.path, {"max_abs_err": 0.0, "rel_err": 0.0, "atol": leaf.atol, "rtol": leaf.rtol})
            w["max_abs_err"] = max(w["max_abs_err"], leaf.max_abs_err)
            w["rel_err"] = max(w["rel_err"], leaf.rel_err)
    return {
        "enabled": True,
        "passed": all(p.passed for p in probes),
        "atol": spec.atol,
        "rtol": spec.rtol,
        "outputs": [{"path": path, **errs} for path, errs in worst.items()],
        "probes": [p.to_json() for p in probes],
    }


def _output_specs(program: torch.export.ExportedProgram, spec: BuildSpec) -> list[dict[str, Any]]:
    """Shape and dtype of each flattened output, dynamic dims by their names."""
    names: dict[Any, str] = {}
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    for inp in spec.inputs:
        node = placeholders.get(inp.name)
        if node is None:
            continue
        for axis, dim in inp.dynamic.items():
            size = node.meta["val"].shape[axis]
            if isinstance(size, torch.SymInt):
                names[size.node.expr] = dim.name
    output = next(n for n in program.graph.nodes if n.op == "output")
    specs = []
    for node in output.args[0]:
        val = node.meta.get("val") if hasattr(node, "meta") else None
        if not isinstance(val, torch.Tensor):
            specs.append({"shape": None, "dtype": type(val).__name__})
            continue
        shape = []
        for size in val.shape:
            if isinstance(size, torch.SymInt):
                expr = size.node.expr
                shape.append(str(expr.subs({s: _symbol(names[s]) for s in expr.free_symbols if s in names})))
            else:
                shape.append(int(size))
        specs.append({"shape": shape, "dtype": str(val.dtype).removeprefix("torch.")})
    return specs


def _symbol(name: str) -> Any:
    import sympy

    return sympy.Symbol(name)


def _jsonable(options: Mapping[str, Any]) -> dict[str, Any]:
    return {
        k: (v if isinstance(v, (str, int, float, bool, type(None), list, dict)) else repr(v))
        for k, v in options.items()
    }


__all__ = ["MANIFEST", "BuildResult", "build", "build_key"]
