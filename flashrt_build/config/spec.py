"""A composed config becomes a validated, typed `BuildSpec`: one resolver
per config group (module.py, compiler.py, paths.py and the small ones here),
sharing one problem collector.

Pure logic with no torch import, so config mistakes are reported before any
heavy work starts, and all of them at once.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from ..artifact import SINGLE_MODEL, default_method, tf32_policy
from ..errors import ConfigError
from ..runtime.dtypes import DEFAULT_TOLERANCES, FLOATING
from ..runtime.formats import Checkpoint
from .compiler import flatten_options, probe_compiler, profile_options, resolve_compiler
from .files import InputFile, model_files
from .inputs import InputSpec, MethodSpec, canonical_dtype
from .keys import removed_keys, unknown_keys
from .llm import register_resolvers
from .module import resolve_module
from .paths import derive_output_dir, resolve_outputs
from .problems import Problems, raise_all
from .quant import QuantRecipe
from .remote_code import auto_map_problems
from .schema import PASS_SWITCHES, StateMode, WeightsMode, plain

__all__ = ["TF32_TOLERANCES", "BuildSpec", "derive_output_dir", "flatten_options", "profile_options", "resolve_spec"]

_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")
# TF32 keeps float16's mantissa: float32 builds that allow it are judged by float16's tolerances.
TF32_TOLERANCES = DEFAULT_TOLERANCES["float16"]


@dataclass(frozen=True)
class BuildSpec:
    """Everything one build needs, resolved and checked."""

    name: str
    model: Mapping[str, Any]
    target: str  # the `_target_` dotted path
    methods: tuple[MethodSpec, ...]  # one (forward) unless the config lists `methods`
    checkpoint: Checkpoint | None
    checkpoint_rename: tuple[tuple[str, str], ...]  # (pattern, replacement), first match wins
    input_files: tuple[InputFile, ...]  # every file the build reads: inputs of its key
    device: str
    dtype: str
    tf32_asked: bool  # target.tf32; `tf32` is the policy the calls run under
    inductor_options: Mapping[str, Any]
    weights: WeightsMode
    output_root: Path
    output_dir: Path
    seed: int
    verify: bool
    atol: float | None
    rtol: float | None
    allow_nonfinite: bool
    repeat: int
    verify_timeout: float
    bench: bool
    release: bool
    force: bool
    threads: int | None
    config: Mapping[str, Any]  # the resolved config, JSON-ready: the manifest's record, read by nothing else
    state_mode: StateMode = StateMode.in_place
    cuda_graphs: bool = False  # the loader's default (serve.cuda_graphs)
    max_graphs: int = 8
    # inductor.methods: per method, options over `inductor_options` (flattened)
    method_inductor_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    quant: QuantRecipe | None = None  # None: weights as the module holds them
    passes: str = "none"  # the `passes` group's name
    # passes.<switch>, one field each of schema.PASS_SWITCHES (test_spec checks they are the same)
    fuse_projections: bool = False  # passes.fuse_projections
    grouped_attention: bool = False  # passes.grouped_attention
    gemv: bool = False  # passes.gemv
    gemv_fusion: bool = False  # passes.gemv_fusion
    decode_attention: bool = False  # passes.decode_attention
    rotary_fusion: bool = False  # passes.rotary_fusion
    one_kernel_attention: bool = False  # passes.one_kernel_attention
    combo_kernels: bool = False  # passes.combo_kernels
    pdl: bool = False  # passes.pdl
    import_paths: tuple[Path, ...] = ()  # where the module's code imports from (python_path, the cwd)
    allowed_targets: tuple[str, ...] = ()  # the effective allow-list of `_target_`s; (): any
    target_name: str = ""  # the target profile's name (`target.name`)

    @property
    def any_pass(self) -> bool:
        """Does the `passes` group turn any pass on?"""
        return any(getattr(self, switch) for switch in PASS_SWITCHES)

    @property
    def combo_methods(self) -> tuple[str, ...]:
        """The methods the combo_kernels pass compiles with Inductor's combo
        kernels: on a CUDA device, those whose inputs have no dynamic
        dimension (a decode step, where it was measured)."""
        if not self.combo_kernels or not self.device.startswith("cuda"):
            return ()
        return tuple(m.name for m in self.methods if not any(i.dynamic for i in m.inputs))

    def method_inductor_options_of(self, method: str) -> dict[str, Any]:
        """Inductor options `method`'s compile sets over the profile's: the
        combo_kernels pass's, then its own `inductor.methods` entry (which wins)."""
        passes = {"combo_kernels": True} if method in self.combo_methods else {}
        return {**passes, **self.method_inductor_options.get(method, {})}

    @property
    def default_method(self) -> MethodSpec:
        """What `m(...)` calls: the method that runs the module's forward, else the first."""
        chosen = default_method({m.name: m.attr for m in self.methods})
        return next(m for m in self.methods if m.name == chosen)

    @property
    def tf32(self) -> bool | None:
        """TF32 on or off for a float32 CUDA target; None: torch's settings are left alone."""
        return tf32_policy(self.device, self.dtype, self.tf32_asked)

    @property
    def inputs(self) -> tuple[InputSpec, ...]:
        return self.default_method.inputs

    @property
    def kwargs(self) -> Mapping[str, Any]:
        return self.default_method.kwargs

    @property
    def serve_defaults(self) -> dict[str, Any]:
        """The loader's defaults (`serve`): the manifest's, and the build key's."""
        return {"cuda_graphs": self.cuda_graphs, "max_graphs": self.max_graphs}

    @property
    def multi_method(self) -> bool:
        return self.methods[0].model != SINGLE_MODEL


def resolve_spec(cfg: DictConfig, cwd: Path | None = None, probe_compiler: bool = True) -> BuildSpec:
    """Validate a composed config and resolve it into a `BuildSpec`, one
    config group after another; every problem is collected and all of them
    are raised as one ConfigError. `probe_compiler`: run the C++ compiler
    too (a plan leaves that to the build: `check_compiler`)."""
    cwd = cwd or Path.cwd()
    config = resolved_config(cfg)
    problems = Problems()
    module = resolve_module(config, cwd, problems)
    device, dtype, tf32 = resolve_target(config["target"], problems)
    checks = resolve_checks(config, device, dtype, tf32, problems)
    switches: dict[str, Any] = {switch: bool(config["passes"][switch]) for switch in PASS_SWITCHES}
    compiler = resolve_compiler(config, module.methods, problems, probe_compiler)
    output_root, output_dir = resolve_outputs(config, cwd, problems)
    named = {config["module"]["pretrained"]: "module.pretrained"} if config["module"].get("pretrained") else {}
    files = module.files + (problems.check(model_files, module.model, cwd, output_root, named) or [])
    problems += auto_map_problems(module.model, cwd, list(module.allowed_targets), named)  # before any code is read
    problems.raise_all()
    assert output_dir is not None and dtype is not None
    # Float inputs follow the target dtype, so the manifest says what the package takes.
    methods = tuple(
        replace(m, inputs=tuple(replace(i, dtype=dtype) if i.dtype in FLOATING else i for i in m.inputs))
        for m in module.methods
    )
    return BuildSpec(
        name=module.name,
        model=module.model,
        target=module.target,
        methods=methods,
        checkpoint=module.checkpoint,
        checkpoint_rename=module.checkpoint_rename,
        input_files=tuple(files),
        device=device,
        dtype=dtype,
        tf32_asked=tf32,
        inductor_options=compiler.inductor_options,
        weights=WeightsMode(config["weights"]),
        output_root=output_root,
        output_dir=output_dir,
        seed=int(config["seed"]),
        release=bool(config["release"]),
        force=bool(config["force"]),
        config=config,
        method_inductor_options=compiler.method_inductor_options,
        quant=compiler.quant,
        passes=str(config["passes"]["name"]),
        **switches,
        import_paths=module.import_paths,
        allowed_targets=module.allowed_targets,
        target_name=str(config["target"]["name"]),
        **checks,
    )


def check_toolchain(spec: BuildSpec) -> None:
    """The compiler the build will call compiles: a ConfigError naming the
    key that chose it, before any work (resolve_spec's probe, for a plan)."""
    problems = Problems()
    probe_compiler(spec.config, spec.inductor_options.get("cpp.march"), problems)
    problems.raise_all()


def resolved_config(cfg: DictConfig) -> dict[str, Any]:
    """The composed config as plain values, interpolations resolved (the
    manifest records it); a key the schema lacks (a typo added with `+`) or a
    missing mandatory value is a ConfigError first."""
    raise_all(unknown_keys(plain(cfg)))  # they would be ignored
    raise_all(removed_keys(plain(cfg)))  # `~seed`: every later step reads them
    if cfg.get("module") is None:
        raise ConfigError("module", None, "no module given: add +module=NAME (see conf/module/)")
    register_resolvers()
    try:
        config = plain(cfg, resolve=True, enum_to_str=True, throw_on_missing=True)
    except Exception as exc:  # an interpolation or a missing mandatory value
        cause: BaseException | None = exc
        while cause is not None and not isinstance(cause, ConfigError):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:  # a resolver's own (what module.pretrained lacks)
            raise cause from None
        key = getattr(exc, "full_key", "?")
        raise ConfigError(key, "???", f"a value is required ({type(exc).__name__})") from None
    return config


def resolve_target(target: Mapping[str, Any], problems: Problems) -> tuple[str, str | None, bool]:
    """The `target` group: (device, dtype, whether TF32 is asked for)."""
    device = target["device"]
    if not _DEVICE.match(device):
        problems.append(ConfigError("target.device", device, "expected cpu, cuda or cuda:INDEX"))
    dtype = problems.check(canonical_dtype, "target.dtype", target["dtype"])
    if dtype is not None and dtype not in FLOATING:
        problems.append(ConfigError("target.dtype", dtype, f"expected a float dtype, one of {sorted(FLOATING)}"))
    if target.get("tf32") and not device.startswith("cuda"):
        problems.append(ConfigError("target.tf32", True, "TF32 is a CUDA setting; use target=cuda or drop it"))
    elif target.get("tf32") and dtype not in (None, "float32"):
        problems.append(
            ConfigError("target.tf32", True, f"TF32 applies to float32 targets; target.dtype is {dtype}, drop it")
        )
    return device, dtype, bool(target.get("tf32"))


def resolve_checks(
    config: Mapping[str, Any], device: str, dtype: str | None, tf32: bool, problems: Problems
) -> dict[str, Any]:
    """The `verify` and `serve` groups and `threads`, as BuildSpec's fields."""
    verify, serve, threads = config["verify"], config["serve"], config.get("threads")
    for key in ("atol", "rtol"):
        if verify[key] is not None and not verify[key] >= 0:
            problems.append(ConfigError(f"verify.{key}", verify[key], "expected a number >= 0"))
    if verify["repeat"] < 0:
        problems.append(ConfigError("verify.repeat", verify["repeat"], "expected a count >= 0"))
    if not verify["timeout"] > 0:
        problems.append(ConfigError("verify.timeout", verify["timeout"], "expected seconds > 0"))
    if serve["cuda_graphs"] and not device.startswith("cuda"):
        problems.append(ConfigError("serve.cuda_graphs", True, "CUDA graphs need a CUDA target: use target=cuda"))
    if serve["max_graphs"] < 0:
        problems.append(ConfigError("serve.max_graphs", serve["max_graphs"], "expected a count >= 0"))
    if threads is not None and threads < 1:
        problems.append(ConfigError("threads", threads, "expected a thread count >= 1, or null for all cores"))
    atol, rtol = TF32_TOLERANCES if tf32 and dtype == "float32" else (None, None)
    least = config["quant"].get("rtol")  # a recipe quantizing activations as it runs
    if least is not None and not least >= 0:
        problems.append(ConfigError("quant.rtol", least, "expected a relative error >= 0, or null"))
    elif least is not None:
        rtol = max(DEFAULT_TOLERANCES.get(dtype or "float32", (0.0, 0.0))[1] if rtol is None else rtol, least)
    return {
        "verify": bool(verify["enabled"]),
        "atol": atol if verify["atol"] is None else verify["atol"],
        "rtol": rtol if verify["rtol"] is None else verify["rtol"],
        "allow_nonfinite": bool(verify["allow_nonfinite"]),
        "repeat": int(verify["repeat"]),
        "verify_timeout": float(verify["timeout"]),
        "bench": bool(verify["bench"]),
        "threads": threads,
        "state_mode": StateMode(serve["state"]),
        "cuda_graphs": bool(serve["cuda_graphs"]),
        "max_graphs": int(serve["max_graphs"]),
    }
