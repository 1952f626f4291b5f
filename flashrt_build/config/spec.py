"""Stage 1: a composed config becomes a validated, typed `BuildSpec`.

Pure logic with no torch import, so config mistakes are reported before any
heavy work starts, and all of them at once.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ..errors import ConfigError, raise_all
from .checkpoint import Checkpoint, resolve_checkpoint
from .compiler import check_compiler, compiler_path, march_rejected
from .files import InputFile, checkpoint_files, model_files
from .paths import check_output_dir, check_temp_dir, check_writable
from .schema import WeightsMode, unknown_keys

# torch dtype names accepted in configs, with the usual short aliases.
DTYPES = {
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float64": "float64",
    "double": "float64",
    "int64": "int64",
    "long": "int64",
    "int32": "int32",
    "int": "int32",
    "int16": "int16",
    "int8": "int8",
    "uint8": "uint8",
    "bool": "bool",
}
FLOAT_DTYPES = {"float32", "float16", "bfloat16", "float64"}
INTEGER_DTYPES = {"int64", "int32", "int16", "int8", "uint8"}
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")
# TF32 keeps 10 mantissa bits, like float16: float32 builds that allow it get float16's tolerances.
TF32_TOLERANCES = (1e-2, 1e-2)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class DimSpec:
    name: str
    min: int
    max: int


@dataclass(frozen=True)
class InputSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str
    dynamic: Mapping[int, DimSpec]
    # The values an integer input may hold, low inclusive, high exclusive (a
    # token id below the vocabulary size); None: not declared. Examples are
    # drawn from it and every call of the package is checked against it.
    low: int | None
    high: int | None
    positional: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "dynamic": {
                str(axis): {"name": d.name, "min": d.min, "max": d.max} for axis, d in sorted(self.dynamic.items())
            },
            "positional": self.positional,
            "low": self.low,
            "high": self.high,
        }


# The package model a module without `methods` compiles to (AOTInductor's default name).
SINGLE_MODEL = "model"


@dataclass(frozen=True)
class MethodSpec:
    """One entry point of the package: a module method and its inputs."""

    name: str  # how users call it: m(...) for forward, m.NAME(...) otherwise
    attr: str  # the module method it calls
    inputs: tuple[InputSpec, ...]
    kwargs: Mapping[str, Any]
    model: str  # its model inside the .pt2
    key: str  # its config key, for messages: `module` or `module.methods.NAME`

    @property
    def label(self) -> str:
        """How logs and errors name it: the method, unless it is a lone forward."""
        return "" if self.model == SINGLE_MODEL else self.name


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
    tf32: bool | None  # None: not a float32 CUDA target, torch's settings are left alone
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
    config: Mapping[str, Any]  # the resolved config, JSON-ready

    @property
    def default_method(self) -> MethodSpec:
        """What `m(...)` calls: the method that runs the module's forward, else the first."""
        return next((m for m in self.methods if m.attr == "forward"), self.methods[0])

    @property
    def inputs(self) -> tuple[InputSpec, ...]:
        return self.default_method.inputs

    @property
    def kwargs(self) -> Mapping[str, Any]:
        return self.default_method.kwargs

    @property
    def multi_method(self) -> bool:
        return self.methods[0].model != SINGLE_MODEL


# What a release build may instantiate without the user widening
# allowed_targets: the shipped configs' own targets, each by name
# (tests/config/test_spec.py keeps this list equal to them).
RELEASE_TARGETS = (
    "flashrt_build.examples.MLP",
    "flashrt_build.examples.T5Seq2Seq",
    "flashrt_build.examples.TinyLM",
    "torchvision.models.resnet50",
    "transformers.BertConfig",
    "transformers.AutoModelForCausalLM.from_pretrained",
    "transformers.BertModel",
    "transformers.GPT2Config",
    "transformers.GPT2LMHeadModel",
    "transformers.LlamaConfig",
    "transformers.LlamaForCausalLM",
    "transformers.T5Config",
)


RELEASE_MARCH = "x86-64-v3"


def profile_options(config: Mapping[str, Any]) -> dict[str, Any]:
    """Inductor options the target and the release profile set: a pinned CPU
    level instead of -march=native, and no line tables (they embed paths)."""
    options: dict[str, Any] = {}
    march = config["target"].get("march") or (RELEASE_MARCH if config.get("release") else None)
    if march and config["target"]["device"] == "cpu":
        options["cpp.march"] = march
    if config.get("release"):
        options["aot_inductor.enable_line_tables"] = False
    return options


def tf32_policy(device: str, dtype: str | None, tf32: bool | None) -> bool | None:
    """The float32 precision a target's calls run under: TF32 on or off for a
    float32 CUDA target; None for any other, whose calls leave torch's flags
    alone (bf16 and fp16 matmuls never read them)."""
    return bool(tf32) if device.startswith("cuda") and dtype == "float32" else None


def allowed_targets(config: Mapping[str, Any]) -> list[str]:
    """The effective allow-list: the config's patterns, plus the zoo for a release."""
    patterns = list(config.get("allowed_targets") or [])
    if config.get("release"):
        patterns = [*RELEASE_TARGETS, *patterns]
    return patterns


def target_allowed(target: str, patterns: list[str], real_name: str | None = None) -> bool:
    """Is a `_target_` on the allow-list? Before import, by the path as written
    (`real_name` None). After Hydra located the object, also by what it really
    is, `module.qualname`, because Hydra follows attributes through modules:
    `transformers.modeling_utils.torch.save` is torch's `save`. A pattern that
    names the path exactly, without wildcards, admits it as written."""
    if not any(fnmatch.fnmatchcase(target, pattern) for pattern in patterns):
        return False
    if real_name is None or target in patterns:
        return True
    return any(fnmatch.fnmatchcase(real_name, pattern) for pattern in patterns)


def find_targets(node: Any, key: str) -> list[tuple[str, Any]]:
    """Every `_target_` in a config node at any depth (nested arguments,
    `_args_` lists, `_partial_` nodes), with its full key."""
    found = []
    if isinstance(node, Mapping):
        if "_target_" in node:
            found.append((f"{key}._target_", node["_target_"]))
        for k, v in node.items():
            if k != "_target_":
                found += find_targets(v, f"{key}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            found += find_targets(v, f"{key}.{i}")
    return found


def canonical_dtype(key: str, name: object) -> str:
    """The torch name of a dtype given in a config, or a ConfigError."""
    if isinstance(name, str) and name in DTYPES:
        return DTYPES[name]
    raise ConfigError(key, name, f"expected a dtype name, one of {sorted(set(DTYPES.values()))}")


def flatten_options(options: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{cpp: {march: x}}` and `{"cpp.march": x}` both become `{"cpp.march": x}`."""
    flat: dict[str, Any] = {}
    for key, value in options.items():
        full = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_options(value, prefix=f"{full}."))
        else:
            flat[full] = value
    return flat


def resolve_spec(cfg: DictConfig, cwd: Path | None = None) -> BuildSpec:
    """Validate a composed config and resolve it into a `BuildSpec`.

    Collects every problem it finds and raises them as one ConfigError.
    """
    cwd = cwd or Path.cwd()
    # Keys the schema lacks (a typo added with `+`) first: they would be ignored.
    raise_all(unknown_keys(OmegaConf.to_container(cfg, resolve=False)))
    if cfg.get("module") is None:
        raise ConfigError("module", None, "no module given: add +module=NAME (see conf/module/)")
    try:
        config = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True, throw_on_missing=True)
    except Exception as exc:  # an interpolation or a missing mandatory value
        key = getattr(exc, "full_key", "?")
        raise ConfigError(key, "???", f"a value is required ({type(exc).__name__})") from None
    assert isinstance(config, dict)
    problems: list[ConfigError] = []

    def check(fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except ConfigError as exc:
            problems.append(exc)
            return None

    module = config["module"]
    name = module["name"]
    if not isinstance(name, str) or not _NAME.match(name):
        problems.append(ConfigError("module.name", name, "expected letters, digits, '_', '.', '-'"))
    model = module["model"]
    target = model.get("_target_") if isinstance(model, dict) else None
    if not isinstance(target, str) or not target:
        problems.append(ConfigError("module.model._target_", target, "expected a dotted import path"))
    allowed = allowed_targets(config)
    for key, value in find_targets(model, "module.model"):
        if not isinstance(value, str) or not value:
            if key != "module.model._target_":  # reported above
                problems.append(ConfigError(key, value, "expected a dotted import path"))
        elif allowed and not target_allowed(value, allowed):
            problems.append(ConfigError(key, value, f"not allowed; allowed_targets: {allowed}"))
    methods = _resolve_methods(module, check)

    device = config["target"]["device"]
    if not _DEVICE.match(device):
        problems.append(ConfigError("target.device", device, "expected cpu, cuda or cuda:INDEX"))
    dtype = check(canonical_dtype, "target.dtype", config["target"]["dtype"])
    if dtype is not None and dtype not in FLOAT_DTYPES:
        problems.append(ConfigError("target.dtype", dtype, f"expected a float dtype, one of {sorted(FLOAT_DTYPES)}"))
    if config["target"].get("tf32") and not device.startswith("cuda"):
        problems.append(ConfigError("target.tf32", True, "TF32 is a CUDA setting; use target=cuda or drop it"))
    elif config["target"].get("tf32") and dtype not in (None, "float32"):
        problems.append(
            ConfigError("target.tf32", True, f"TF32 applies to float32 targets; target.dtype is {dtype}, drop it")
        )
    tf32 = tf32_policy(device, dtype, config["target"].get("tf32"))

    checkpoint = module.get("checkpoint")
    resolved = check(resolve_checkpoint, "module.checkpoint", checkpoint, cwd / checkpoint) if checkpoint else None
    rename = _resolve_renames(module.get("checkpoint_rename") or [], checkpoint, problems)

    verify = config["verify"]
    for key in ("atol", "rtol"):
        if verify[key] is not None and not verify[key] >= 0:
            problems.append(ConfigError(f"verify.{key}", verify[key], "expected a number >= 0"))

    if config.get("variant") is not None and not _NAME.match(str(config["variant"])):
        problems.append(ConfigError("variant", config["variant"], "expected letters, digits, '_', '.', '-'"))
    if verify["repeat"] < 0:
        problems.append(ConfigError("verify.repeat", verify["repeat"], "expected a count >= 0"))
    if not verify["timeout"] > 0:
        problems.append(ConfigError("verify.timeout", verify["timeout"], "expected seconds > 0"))
    threads = config.get("threads")
    if threads is not None and threads < 1:
        problems.append(ConfigError("threads", threads, "expected a thread count >= 1, or null for all cores"))
    cxx = config["toolchain"]["cxx"]
    before_compiler = len(problems)
    check(check_compiler, cxx)
    compiler_found = len(problems) == before_compiler
    check(check_temp_dir)
    options = flatten_options(config["inductor"]["options"] or {})
    if cxx is not None:
        options["cpp.cxx"] = cxx
    options.update(profile_options(config))
    march = options.get("cpp.march")
    if march and compiler_found:
        rejected = march_rejected(compiler_path(cxx), str(march))
        if rejected:
            key = (
                "target.march"
                if config["target"].get("march") or config.get("release")
                else "inductor.options.cpp.march"
            )
            problems.append(ConfigError(key, march, f"{compiler_path(cxx)} rejects -march={march}: {rejected}"))
    output_dir = check(derive_output_dir, config, cwd)
    before_paths = len(problems)
    output_root = (cwd / config["output_root"]).resolve()
    files = check(model_files, model, cwd, output_root) or []
    if resolved is not None:
        files = checkpoint_files(resolved) + files
    root_ok = check(check_writable, output_root, "output_root", False) is None and len(problems) == before_paths
    if output_dir is not None and (root_ok or config.get("output_dir")):  # a derived dir fails with its root
        before_dir = len(problems)
        check(check_writable, output_dir, "output_dir")
        if len(problems) == before_dir:  # what publishing would replace
            check(check_output_dir, output_dir, output_root, cwd, config.get("output_dir"))

    raise_all(problems)
    # Float inputs follow the target dtype, so the manifest says what the package takes.
    methods = tuple(
        replace(m, inputs=tuple(replace(i, dtype=dtype) if i.dtype in FLOAT_DTYPES else i for i in m.inputs))
        for m in methods
    )

    return BuildSpec(
        name=name,
        model=model,
        target=target,
        methods=methods,
        checkpoint=resolved,
        checkpoint_rename=rename,
        input_files=tuple(files),
        device=device,
        dtype=dtype,
        tf32=tf32,
        inductor_options=options,
        weights=WeightsMode(config["weights"]),
        output_root=output_root,
        output_dir=output_dir,
        seed=int(config["seed"]),
        verify=bool(verify["enabled"]),
        atol=TF32_TOLERANCES[0] if verify["atol"] is None and tf32 and dtype == "float32" else verify["atol"],
        rtol=TF32_TOLERANCES[1] if verify["rtol"] is None and tf32 and dtype == "float32" else verify["rtol"],
        allow_nonfinite=bool(verify["allow_nonfinite"]),
        repeat=int(verify["repeat"]),
        verify_timeout=float(verify["timeout"]),
        bench=bool(verify["bench"]),
        release=bool(config["release"]),
        force=bool(config["force"]),
        threads=threads,
        config=config,
    )


# LoadedModule's own attributes and the nn.Module methods a user calls: a
# package method of one of these names would be shadowed by it.
RESERVED_METHODS = frozenset(
    [
        "state",
        "manifest",
        "host",
        "output_dir",
        "bound_weights",
        "methods",
        "constant_fqns",
        "to",
        "cpu",
        "cuda",
        "eval",
        "train",
        "apply",
        "parameters",
        "buffers",
        "modules",
        "children",
        "state_dict",
        "load_state_dict",
        "half",
        "float",
        "double",
        "type",
    ]
)


def _resolve_methods(module: Mapping[str, Any], check: Any) -> list[MethodSpec]:
    """The package's entry points: `module.methods`, or the forward of `module.inputs`."""
    declared = module.get("methods") or {}
    if not declared:
        if not module["inputs"]:
            check(_fail, "module.inputs", {}, "expected at least one input (or module.methods, one entry per method)")
        entries = [("forward", "forward", module["inputs"], module.get("kwargs") or {}, SINGLE_MODEL, "module")]
    else:
        for key in ("inputs", "kwargs"):
            if module.get(key):
                check(_fail, f"module.{key}", module[key], f"with module.methods, give each method's {key} there")
        entries = [
            (name, raw.get("method") or name, raw["inputs"], raw.get("kwargs") or {}, name, f"module.methods.{name}")
            for name, raw in declared.items()
        ]
    methods = []
    for name, attr, raw_inputs, kwargs, model, key in entries:
        if not name.isidentifier() or name.startswith("_") or name in RESERVED_METHODS:
            check(_fail, key, name, "a method name must be a public Python identifier, not a LoadedModule attribute")
        if not isinstance(attr, str) or not attr.isidentifier():
            check(_fail, f"{key}.method", attr, "expected the name of a method of the module")
        if declared and not raw_inputs:
            check(_fail, f"{key}.inputs", {}, "expected at least one input")
        inputs = tuple(
            spec
            for spec in (check(_resolve_input, in_name, raw, key) for in_name, raw in raw_inputs.items())
            if spec is not None
        )
        check(_check_shared_dims, inputs, key)
        methods.append(MethodSpec(name, attr, inputs, dict(kwargs), model, key))
    return methods


def _resolve_renames(
    rules: list[Mapping[str, Any]], checkpoint: str | None, problems: list[ConfigError]
) -> tuple[tuple[str, str], ...]:
    """`module.checkpoint_rename` as (pattern, replacement) pairs, each pattern a valid regex."""
    if rules and not checkpoint:
        problems.append(
            ConfigError("module.checkpoint_rename", rules, "renames the names of a checkpoint: set module.checkpoint")
        )
    for i, rule in enumerate(rules):
        try:
            re.compile(rule["pattern"])
        except re.error as exc:
            problems.append(
                ConfigError(
                    f"module.checkpoint_rename.{i}.pattern", rule["pattern"], f"not a regular expression ({exc})"
                )
            )
    return tuple((rule["pattern"], rule.get("replace") or "") for rule in rules)


def _fail(key: str, value: object, expected: str) -> None:
    raise ConfigError(key, value, expected)


def _resolve_input(name: str, raw: Mapping[str, Any], method_key: str = "module") -> InputSpec:
    key = f"{method_key}.inputs.{name}"
    if not _NAME.match(name) or "." in name:
        raise ConfigError(key, name, "an input name must be a Python identifier")
    shape = tuple(raw["shape"])
    if any(not isinstance(n, int) or n <= 0 for n in shape):
        raise ConfigError(f"{key}.shape", list(shape), "expected positive integer sizes")
    dtype = canonical_dtype(f"{key}.dtype", raw["dtype"])
    dynamic: dict[int, DimSpec] = {}
    for raw_axis, rng in (raw.get("dynamic") or {}).items():
        dkey = f"{key}.dynamic.{raw_axis}"
        axis = int(raw_axis) if str(raw_axis).lstrip("-").isdigit() else None
        if axis is None or not 0 <= axis < len(shape):
            raise ConfigError(f"{key}.dynamic", raw_axis, f"expected an integer axis in [0, {len(shape)})")
        lo, hi = rng["min"], rng["max"]
        if lo < 1 or hi < lo:
            raise ConfigError(dkey, {"min": lo, "max": hi}, "expected 1 <= min <= max")
        if not lo <= shape[axis] <= hi:
            raise ConfigError(
                f"{key}.shape", list(shape), f"axis {axis} = {shape[axis]} lies outside its dynamic range [{lo}, {hi}]"
            )
        dynamic[axis] = DimSpec(name=rng.get("name") or f"{name}_{axis}", min=lo, max=hi)
    low, high = raw.get("low"), raw.get("high")
    if (low is not None or high is not None) and dtype not in INTEGER_DTYPES:
        which = "low" if low is not None else "high"
        raise ConfigError(f"{key}.{which}", raw[which], f"low/high apply to integer inputs only; this one is {dtype}")
    if low is not None and high is not None and high <= low:
        raise ConfigError(f"{key}.high", high, f"expected high > low = {low}")
    return InputSpec(name, shape, dtype, dynamic, low, high, bool(raw.get("positional")))


def _check_shared_dims(inputs: tuple[InputSpec, ...], method_key: str = "module") -> None:
    """Axes that share a dim name must agree on its range and example size."""
    seen: dict[str, tuple[DimSpec, int, str]] = {}
    for spec in inputs:
        for axis, dim in spec.dynamic.items():
            where = f"{method_key}.inputs.{spec.name}.dynamic.{axis}"
            if dim.name in seen:
                first, size, first_where = seen[dim.name]
                if (first.min, first.max, size) != (dim.min, dim.max, spec.shape[axis]):
                    raise ConfigError(
                        where, dim.name, f"dim '{dim.name}' must match {first_where} (range and example size)"
                    )
            else:
                seen[dim.name] = (dim, spec.shape[axis], where)


def derive_output_dir(config: Mapping[str, Any], cwd: Path) -> Path:
    """The build's output directory: `output_dir`, or one derived from choices.

    Derived: `<output_root>/<module>/<target>-<weights>-<inductor>[-<variant>]`,
    never a timestamp, so a rebuild lands where the last one did.
    """
    root = (cwd / config["output_root"]).resolve()
    if config.get("output_dir"):
        return (cwd / config["output_dir"]).resolve()
    parts = [config["target"]["name"], str(config["weights"]), config["inductor"]["name"]]
    if config.get("variant"):
        parts.append(config["variant"])
    leaf = "-".join(parts)
    name = config["module"]["name"]
    if not _NAME.match(name) or not _NAME.match(leaf):
        return root / "invalid"  # module.name or variant is reported by resolve_spec
    path = (root / name / leaf).resolve()
    if root not in path.parents:
        raise ConfigError("module.name", name, f"the build directory must stay inside output_root {root}")
    return path
