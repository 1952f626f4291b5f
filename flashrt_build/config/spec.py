"""Stage 1: a composed config becomes a validated, typed `BuildSpec`.

Pure logic with no torch import, so config mistakes are reported before any
heavy work starts, and all of them at once.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ..artifact import SINGLE_MODEL, default_method, tf32_policy
from ..errors import ConfigError, raise_all
from ..runtime.dtypes import FLOATING
from ..runtime.formats import Checkpoint, resolve_checkpoint
from .files import InputFile, checkpoint_files, model_files, served_files
from .inputs import NAME, InputSpec, MethodSpec, canonical_dtype, resolve_methods
from .llm import register_resolvers
from .paths import check_output_dir, check_temp_dir, check_writable
from .quant import QuantRecipe, resolve_quant
from .schema import StateMode, WeightsMode, unknown_keys
from .targets import allow_list_refusal, allowed_targets, find_targets, remote_code_problems, target_allowed
from .toolchain import check_compiler, compiler_path, march_rejected

_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")
# TF32 keeps 10 mantissa bits, like float16: float32 builds that allow it get float16's tolerances.
TF32_TOLERANCES = (1e-2, 1e-2)


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
    state_mode: StateMode = StateMode.in_place
    cuda_graphs: bool = False  # the loader's default (serve.cuda_graphs)
    max_graphs: int = 8
    # inductor.methods: per method, options over `inductor_options` (flattened)
    method_inductor_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    quant: QuantRecipe | None = None  # None: weights as the module holds them
    import_paths: tuple[Path, ...] = ()  # where the module's code imports from (python_path, the cwd)

    @property
    def default_method(self) -> MethodSpec:
        """What `m(...)` calls: the method that runs the module's forward, else the first."""
        chosen = default_method({m.name: m.attr for m in self.methods})
        return next(m for m in self.methods if m.name == chosen)

    @property
    def inputs(self) -> tuple[InputSpec, ...]:
        return self.default_method.inputs

    @property
    def kwargs(self) -> Mapping[str, Any]:
        return self.default_method.kwargs

    @property
    def multi_method(self) -> bool:
        return self.methods[0].model != SINGLE_MODEL


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


def _method_options(
    declared: Mapping[str, Any], methods: list[MethodSpec], problems: list[ConfigError], where: str = "inductor"
) -> dict[str, dict[str, Any]]:
    """`inductor.methods` (or a recipe's), each entry naming one of the module's methods."""
    names = [m.name for m in methods]
    resolved = {}
    for name, options in declared.items():
        if name not in names:
            problems.append(
                ConfigError(
                    f"{where}.methods.{name}", options, f"not a method of this module; its methods: {', '.join(names)}"
                )
            )
        elif not isinstance(options, Mapping):
            problems.append(ConfigError(f"{where}.methods.{name}", options, "expected a mapping of Inductor options"))
        elif options:
            resolved[name] = flatten_options(options)
    return resolved


def resolve_spec(cfg: DictConfig, cwd: Path | None = None) -> BuildSpec:
    """Validate a composed config and resolve it into a `BuildSpec`.

    Collects every problem it finds and raises them as one ConfigError.
    """
    cwd = cwd or Path.cwd()
    # Keys the schema lacks (a typo added with `+`) first: they would be ignored.
    raise_all(unknown_keys(OmegaConf.to_container(cfg, resolve=False)))
    if cfg.get("module") is None:
        raise ConfigError("module", None, "no module given: add +module=NAME (see conf/module/)")
    register_resolvers()
    try:
        config = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True, throw_on_missing=True)
    except Exception as exc:  # an interpolation or a missing mandatory value
        cause: BaseException | None = exc
        while cause is not None and not isinstance(cause, ConfigError):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:  # a resolver's own (what module.pretrained lacks)
            raise cause from None
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
    if not isinstance(name, str) or not NAME.match(name):
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
            problems.append(ConfigError(key, value, allow_list_refusal(value, config)))
    problems += remote_code_problems(model, allowed)
    methods = resolve_methods(module, check)

    device = config["target"]["device"]
    if not _DEVICE.match(device):
        problems.append(ConfigError("target.device", device, "expected cpu, cuda or cuda:INDEX"))
    dtype = check(canonical_dtype, "target.dtype", config["target"]["dtype"])
    if dtype is not None and dtype not in FLOATING:
        problems.append(ConfigError("target.dtype", dtype, f"expected a float dtype, one of {sorted(FLOATING)}"))
    if config["target"].get("tf32") and not device.startswith("cuda"):
        problems.append(ConfigError("target.tf32", True, "TF32 is a CUDA setting; use target=cuda or drop it"))
    elif config["target"].get("tf32") and dtype not in (None, "float32"):
        problems.append(
            ConfigError("target.tf32", True, f"TF32 applies to float32 targets; target.dtype is {dtype}, drop it")
        )
    tf32 = tf32_policy(device, dtype, config["target"].get("tf32"))

    checkpoint = module.get("checkpoint")
    resolved = (
        check(resolve_checkpoint, "module.checkpoint", checkpoint, cwd / Path(checkpoint).expanduser())
        if checkpoint
        else None
    )
    rename = _resolve_renames(module.get("checkpoint_rename") or [], checkpoint, problems)

    verify = config["verify"]
    for key in ("atol", "rtol"):
        if verify[key] is not None and not verify[key] >= 0:
            problems.append(ConfigError(f"verify.{key}", verify[key], "expected a number >= 0"))

    if config.get("variant") is not None and not NAME.match(str(config["variant"])):
        problems.append(ConfigError("variant", config["variant"], "expected letters, digits, '_', '.', '-'"))
    if verify["repeat"] < 0:
        problems.append(ConfigError("verify.repeat", verify["repeat"], "expected a count >= 0"))
    if not verify["timeout"] > 0:
        problems.append(ConfigError("verify.timeout", verify["timeout"], "expected seconds > 0"))
    serve = config["serve"]
    if serve["cuda_graphs"] and not device.startswith("cuda"):
        problems.append(ConfigError("serve.cuda_graphs", True, "CUDA graphs need a CUDA target: use target=cuda"))
    if serve["max_graphs"] < 0:
        problems.append(ConfigError("serve.max_graphs", serve["max_graphs"], "expected a count >= 0"))
    threads = config.get("threads")
    if threads is not None and threads < 1:
        problems.append(ConfigError("threads", threads, "expected a thread count >= 1, or null for all cores"))
    cxx = config["toolchain"]["cxx"]
    before_compiler = len(problems)
    check(check_compiler, cxx)
    compiler_found = len(problems) == before_compiler
    check(check_temp_dir)
    quant = resolve_quant(config["quant"], device, problems)
    # The recipe's options first: the inductor group's own win where both set one.
    options = {
        **flatten_options(config["quant"]["inductor"]["options"] or {}),
        **flatten_options(config["inductor"]["options"] or {}),
    }
    if cxx is not None:
        options["cpp.cxx"] = cxx
    options.update(profile_options(config))
    method_options = _method_options(
        config["quant"]["inductor"].get("methods") or {}, methods, problems, "quant.inductor"
    )
    for name, own in _method_options(config["inductor"].get("methods") or {}, methods, problems).items():
        method_options[name] = {**method_options.get(name, {}), **own}
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
    output_root = (cwd / Path(config["output_root"]).expanduser()).resolve()
    files = check(model_files, model, cwd, output_root) or []
    if resolved is not None:
        files = checkpoint_files(resolved) + files
    files += check(served_files, "module.files", module.get("files") or [], cwd) or []
    root_ok = check(check_writable, output_root, "output_root", False) is None and len(problems) == before_paths
    if output_dir is not None and (root_ok or config.get("output_dir")):  # a derived dir fails with its root
        before_dir = len(problems)
        check(check_writable, output_dir, "output_dir")
        if len(problems) == before_dir:  # what publishing would replace
            check(check_output_dir, output_dir, output_root, cwd, config.get("output_dir"))

    import_paths = _import_paths(config.get("python_path") or [], cwd, problems)
    config["python_path"] = [str(path) for path in import_paths]  # recorded: repro imports from there too

    raise_all(problems)
    # Float inputs follow the target dtype, so the manifest says what the package takes.
    methods = tuple(
        replace(m, inputs=tuple(replace(i, dtype=dtype) if i.dtype in FLOATING else i for i in m.inputs))
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
        state_mode=StateMode(serve["state"]),
        cuda_graphs=bool(serve["cuda_graphs"]),
        max_graphs=int(serve["max_graphs"]),
        method_inductor_options=method_options,
        quant=quant,
        import_paths=tuple(import_paths),
    )


def _import_paths(given: list[str], cwd: Path, problems: list[ConfigError]) -> list[Path]:
    """`python_path`'s directories, resolved, then the working directory."""
    paths = []
    for i, entry in enumerate(given):
        path = (cwd / Path(entry).expanduser()).resolve()
        if not path.is_dir():
            problems.append(ConfigError(f"python_path.{i}", entry, "no such directory to import from"))
        paths.append(path)
    return list(dict.fromkeys([*paths, cwd.resolve()]))


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


def derive_output_dir(config: Mapping[str, Any], cwd: Path) -> Path:
    """The build's output directory: `output_dir`, or one derived from choices.

    Derived: `<output_root>/<module>/<target>-<weights>-<inductor>[-<quant>][-<variant>]`
    (the quant recipe unless `none`), never a timestamp, so a rebuild lands
    where the last one did.
    """
    root = (cwd / Path(config["output_root"]).expanduser()).resolve()
    if config.get("output_dir"):
        return (cwd / Path(config["output_dir"]).expanduser()).resolve()  # `~`: the home directory
    parts = [config["target"]["name"], str(config["weights"]), config["inductor"]["name"]]
    if config.get("quant", {}).get("name", "none") != "none":
        parts.append(config["quant"]["name"])
    if config.get("variant"):
        parts.append(config["variant"])
    leaf = "-".join(parts)
    name = config["module"]["name"]
    if not NAME.match(name) or not NAME.match(leaf):
        return root / "invalid"  # module.name or variant is reported by resolve_spec
    path = (root / name / leaf).resolve()
    if root not in path.parents:
        raise ConfigError("module.name", name, f"the build directory must stay inside output_root {root}")
    return path
