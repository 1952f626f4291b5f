"""The pipeline: config -> spec -> module -> inputs -> exported -> package ->
verified -> published. Each stage is one function from the previous value."""

from __future__ import annotations

import inspect
import logging
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from safetensors.torch import save_file

from . import __version__
from .artifact import MANIFEST, PACKAGE, SCHEMA, SIDECAR, STATE
from .cache.digests import DigestCache
from .cache.key import build_keys, distribution_of, input_digests, key_ingredients, method_keys
from .cache.reuse import check_up_to_date, reuse
from .cache.store import Store, link_or_copy
from .config.compose import as_build_config
from .config.schema import BuildConfig, WeightsMode
from .config.spec import BuildSpec, MethodSpec, resolve_spec
from .runtime.checkpoint import dtype_name
from .runtime.gpu import check_device, fp32_precision, gpu_of
from .runtime.manifest import (
    canonical_sha256,
    config_sha256,
    file_record,
    file_sha256,
    load_contract,
    read_manifest,
    write_manifest,
)
from .stages.domain import check_input_domain, check_input_names
from .stages.export import Exported, export_module
from .stages.inputs import dynamic_shapes, make_inputs
from .stages.module import instantiate_module, locate_target, real_name
from .stages.package import (
    combine_packages,
    compile_package,
    package_constant_fqns,
    seal_package,
    validate_inductor_options,
)
from .stages.progress import StageTimer
from .stages.publish import build_lock, publish, staging_dir
from .stages.threads import apply_threads
from .stages.toolchain import describe_toolchain
from .stages.verify import verify
from .stages.weights import match_package_tensors, tensor_sha256, union_of_methods, write_sidecar

log = logging.getLogger("flashrt_build")


@dataclass
class BuildResult:
    """What `build` produced: where, the manifest, and whether work was done."""

    output_dir: Path
    manifest: dict[str, Any]
    status: str  # "built", "up_to_date" or "from_store"

    @property
    def package(self) -> Path:
        return self.output_dir / PACKAGE


def build(cfg: DictConfig | BuildConfig | Mapping[str, Any], cwd: Path | None = None) -> BuildResult:
    """Build one package from a config and publish it to its output directory."""
    spec = resolve_spec(as_build_config(cfg), cwd)
    apply_threads(spec.threads)
    options = validate_inductor_options(spec.inductor_options, spec.weights)
    check_device(spec.device)
    remembered = DigestCache(Store(spec.output_root).root)
    digests = input_digests(spec, remembered)  # every file the build reads, each read once while it is unchanged
    ingredients = key_ingredients(spec, gpu_of(spec.device), digests)
    keys = build_keys(ingredients)
    reused = reuse(spec, keys, ingredients)
    if reused is not None:
        return BuildResult(spec.output_dir, reused[1], reused[0])
    with fp32_precision(spec.tf32):  # export, compile and verify under the target's TF32 policy
        result = _build(spec, options, keys, ingredients, digests)
    remembered.save(create=True)
    return result


def _build(
    spec: BuildSpec,
    options: dict[str, Any],
    keys: dict[str, str],
    ingredients: dict[str, Any],
    digests: dict[str, str],
) -> BuildResult:
    """The stages of a build that has work to do."""
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
    with timer.stage("inputs"):  # the config's inputs against the eager module, before the costly stages
        for method in spec.methods:
            check_input_names(module, spec, method)
        checked = [check_input_domain(module, spec, method) for method in spec.methods]
        timer.notes["inputs"] = "; ".join(
            f"{m.label + ': ' if m.label else ''}{note}" for m, note in zip(spec.methods, checked, strict=True)
        )
    with timer.stage("export"):
        exported = [_export(module, spec, method) for method in spec.methods]
        timer.notes["export"] = ", ".join(
            f"{e.method.label + ': ' if e.method.label else ''}{len(e.program.graph.nodes)} graph nodes"
            + (f", state threaded: {', '.join(e.state)}" if e.state else "")
            for e in exported
        )
    provenance = _module_provenance(spec, digests)
    toolchain = describe_toolchain(spec.device, options)

    # Builds of one output dir take turns from here to publishing; the stages
    # above run side by side, and a failure there leaves nothing on disk.
    with build_lock(spec.output_dir), staging_dir(spec.output_dir) as staging:
        if not spec.force and check_up_to_date(spec, keys, ingredients)[0]:
            log.info("%s: built meanwhile by another process: %s", spec.name, spec.output_dir)
            return BuildResult(spec.output_dir, read_manifest(spec.output_dir), "up_to_date")
        package_path = staging / PACKAGE
        store = Store(spec.output_root)
        cache = _release_cache(spec, ingredients)
        per_method = method_keys(ingredients) if spec.multi_method else {}
        if spec.multi_method:
            compiled = _compile_methods(spec, exported, options, per_method, store, package_path, cache, timer)
        else:
            compiled = {
                spec.default_method.name: _compile_single(
                    spec, exported[0], options, keys, store, package_path, cache, timer
                )
            }
        with timer.stage("package"):
            bound = {
                e.method.name: match_package_tensors(
                    e.program, package_constant_fqns(package_path, e.method.model), spec.target, e.prefix, e.state
                )
                for e in exported
            }
            tensors, inlined, unused = union_of_methods(bound) if spec.multi_method else bound[spec.default_method.name]
            weights: dict[str, Any] = {"mode": spec.weights.value, "file": None, "sha256": None}
            if spec.weights is WeightsMode.external:
                sidecar = write_sidecar(staging / SIDECAR, tensors)
                weights.update(file=SIDECAR, **file_record(sidecar))
            elif spec.multi_method:
                weights["copies"] = len(spec.methods)  # each method's model holds its own
            threaded = sorted({name for e in exported for name in e.state})
            default = next(e for e in exported if e.method == spec.default_method)
            # What a load relies on: recorded in the package too (seal_package), so an edit of it is caught.
            described: dict[str, Any] = {
                "weights": {
                    **weights,
                    "tensors": [t.to_json() for t in tensors],
                    # constants of the forward's code that Inductor compiled into the kernels
                    "inlined": [t.to_json() for t in inlined],
                    # module tensors the graph never reads: accepted in a checkpoint, not bound
                    "unused": unused,
                },
                "state": _write_state(staging, module, threaded),
                # the default method's (what m(...) calls); every method's under `methods`
                "inputs": [inp.to_json() for inp in default.method.inputs],
                "outputs": _output_specs(default),
                "methods": {
                    e.method.name: {
                        "method": e.method.attr,
                        "model": e.method.model,
                        "inputs": [inp.to_json() for inp in e.method.inputs],
                        "outputs": _output_specs(e),
                        "kwargs": dict(e.method.kwargs),
                        "state": e.state,
                        "compiled": "reused" if compiled[e.method.name] else "built",
                        **({"method_key": per_method[e.method.name]} if spec.multi_method else {}),
                    }
                    for e in exported
                },
                "target": {"device": spec.device, "dtype": spec.dtype, "tf32": spec.tf32},
                "toolchain": toolchain,
            }
            reused = all(compiled.values())
            seal_package(package_path, load_contract(described), already=reused)
            package = {"file": PACKAGE, **file_record(package_path), "reused": reused}
            timer.notes["package"] = f"{package['bytes'] / 1e6:.2f} MB, {len(tensors)} tensors bound"
            if spec.weights is WeightsMode.external:
                timer.notes["package"] += f", sidecar {weights['bytes'] / 1e6:.2f} MB"
            if inlined:
                timer.notes["package"] += f", {len(inlined)} code constants inlined"
        manifest: dict[str, Any] = {
            "schema": SCHEMA,
            "name": spec.name,
            "flashrt_build": __version__,
            "module": provenance,
            # every file the build read (the checkpoint's shards, a from_pretrained directory): inputs of its key
            "build_inputs": [
                {
                    "key": f.key,
                    "file": f.name,
                    "path": str(f.path),
                    "bytes": f.path.stat().st_size,
                    "sha256": digests[f.label],
                    "kind": f.kind,
                }  # fmt: skip
                for f in spec.input_files
            ],
            "package": package,
            **described,
            "inductor": {"options": _jsonable(options)},
            "release": spec.release,
            "config": spec.config,
            "config_sha256": config_sha256(spec.config),
            **keys,
            "key_ingredients": ingredients,
            "verification": {"enabled": False, "passed": None},
            "timings": timer.timings,
        }
        if spec.verify:
            with timer.stage("verify"):
                # In a fresh process, loaded as users load it: digests checked, weights bound.
                record = verify(spec, module, staging, manifest, threaded, spec.repeat, spec.verify_timeout)
                record["gpu"] = gpu_of(spec.device)  # the worker runs on the build's device
                manifest["verification"] = record
                timer.notes["verify"] = f"{len(record['probes'])} calls in a fresh process passed"
                if "bench" in record:
                    ms = record["bench"]["ms"]
                    timer.notes["verify"] += "; median ms " + ", ".join(f"{k} {v['median']:.3f}" for k, v in ms.items())
        else:
            log.warning("verification is off (verify.enabled=false): the package is recorded as unverified")
        with timer.stage("manifest"):
            write_manifest(staging, manifest)
        publish(staging, spec.output_dir)
    if spec.weights is WeightsMode.external and not spec.multi_method:
        store.put("packages", keys["graph_key"], [spec.output_dir / PACKAGE])
    store.put(
        "artifacts",
        keys["build_key"],
        [spec.output_dir / name for name in (PACKAGE, SIDECAR, STATE, MANIFEST) if (spec.output_dir / name).is_file()],
    )
    log.info("artifact: %s", spec.output_dir)
    return BuildResult(spec.output_dir, manifest, "built")


def _export(module: torch.nn.Module, spec: BuildSpec, method: MethodSpec) -> Exported:
    """Stage 3 and 4 for one method: its example inputs, then torch.export."""
    example = make_inputs(spec, method=method)
    return export_module(module, spec, example, dynamic_shapes(spec, example, method), method)


def _compile_single(
    spec: BuildSpec,
    exported: Exported,
    options: dict[str, Any],
    keys: dict[str, Any],
    store: Store,
    package_path: Path,
    cache: Path | None,
    timer: StageTimer,
) -> bool:
    """Stage 5 for a module's forward; True when an earlier compile was reused."""
    previous = store.package(keys["graph_key"]) if spec.weights is WeightsMode.external else None
    if previous is not None:
        # Only the weights differ from a build already compiled: same package.
        link_or_copy(previous, package_path)
        log.info("%-11s %8s  reusing the package of graph %s", "compile", "skipped", keys["graph_key"][:12])
        return True
    with timer.stage("compile"):
        compile_package(exported.program, options, package_path, spec.target, cache)
    return False


def _compile_methods(
    spec: BuildSpec,
    exported: list[Exported],
    options: dict[str, Any],
    method_keys: dict[str, str],
    store: Store,
    package_path: Path,
    cache: Path | None,
    timer: StageTimer,
) -> dict[str, bool]:
    """Stage 5 for several methods: each compiled into a model of its own (or
    reused from the store by its method key), then combined into one .pt2."""
    reused: dict[str, bool] = {}
    scratch = package_path.parent / ".methods"  # inside staging: a killed build leaves nothing behind
    try:
        parts = {}
        for e in exported:
            name, key = e.method.name, method_keys[e.method.name]
            part = scratch / name / PACKAGE
            part.parent.mkdir(parents=True)
            previous = store.package(key, kind="methods")
            reused[name] = previous is not None
            if previous is not None:
                link_or_copy(previous, part)
                log.info("%-11s %8s  %s: reusing the model of method key %s", "compile", "skipped", name, key[:12])
            else:
                with timer.stage(f"compile {name}"):
                    compile_package(e.program, options, part, f"{spec.target} method {name}", cache)
                store.put("methods", key, [part])
            parts[name] = part
        combine_packages(parts, package_path)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return reused


def _release_cache(spec: BuildSpec, ingredients: dict[str, Any]) -> Path | None:
    """A release compiles in a fresh cache at a path fixed by its config alone,
    so the same config gives the same bytes from any directory (the path is
    written into the package) and different configs never share one."""
    if not spec.release:
        return None
    return Path(tempfile.gettempdir()) / "flashrt_build-release" / canonical_sha256(ingredients["config"])[:16]


def _module_provenance(spec: BuildSpec, digests: Mapping[str, str]) -> dict[str, Any]:
    """The target's dotted path, what it really is, its source file digest and
    distribution; the checkpoint it was loaded from, file by file."""
    obj = locate_target(spec.target)
    try:
        source = inspect.getsourcefile(obj)  # type: ignore[arg-type]
    except TypeError:
        source = None
    found = distribution_of(spec.target.split(".")[0])
    dist = {"name": found[0], "version": found[1]} if found else None
    checkpoint = None
    if spec.checkpoint is not None:
        files = [f for f in spec.input_files if f.key == "module.checkpoint"]
        checkpoint = {
            "path": str(spec.checkpoint.path),
            # a lone file's digest; a directory's files are listed one by one
            "sha256": digests[files[0].label] if not spec.checkpoint.path.is_dir() else None,
            "format": spec.checkpoint.format,
            "files": [{"file": f.name, "sha256": digests[f.label]} for f in files],
            "rename": [{"pattern": p, "replace": r} for p, r in spec.checkpoint_rename],
        }
    return {
        "target": spec.target,
        "callable": real_name(obj),  # what the target really is: a class method by its class
        "source_file": source,
        "source_sha256": file_sha256(Path(source)) if source else None,
        "distribution": dist,
        "checkpoint": checkpoint,
        "seed": spec.seed,
    }


def _write_state(staging: Path, module: torch.nn.Module, names: list[str]) -> dict[str, Any] | None:
    """The initial values of threaded buffers, beside the package."""
    if not names:
        return None
    tensors = {name: module.get_buffer(name).detach().to("cpu").contiguous().clone() for name in names}
    path = staging / STATE
    save_file(tensors, str(path))
    return {
        "file": STATE,
        **file_record(path),
        "tensors": [
            {"fqn": n, "shape": list(t.shape), "dtype": dtype_name(t.dtype), "sha256": tensor_sha256(t)}
            for n, t in tensors.items()
        ],
    }


def _output_specs(exported: Exported) -> list[dict[str, Any]]:
    """Shape and dtype of each flattened output of a method, dynamic dims by their names."""
    program, state = exported.program, len(exported.state)
    names: dict[Any, str] = {}
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    for inp in exported.method.inputs:
        node = placeholders.get(inp.name)
        if node is None:
            continue
        for axis, dim in inp.dynamic.items():
            size = node.meta["val"].shape[axis]
            if isinstance(size, torch.SymInt):
                names[size.node.expr] = dim.name
    output = next(n for n in program.graph.nodes if n.op == "output")
    user_outputs = output.args[0][: len(output.args[0]) - state]  # threaded state comes last
    specs = []
    for node in user_outputs:
        if not isinstance(node, torch.fx.Node):  # a constant the method returns (None, 3): the package gives it back
            value = node if isinstance(node, (bool, int, float, str, type(None))) else repr(node)
            specs.append({"shape": None, "dtype": type(node).__name__, "value": value})
            continue
        val = node.meta.get("val")
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


__all__ = ["MANIFEST", "BuildResult", "build"]
