"""The compile resolved: the C++ compiler and the temp dir it compiles in,
the quantization recipe, and the Inductor options of every method (the
recipe's, the `inductor` group's, the target's and the release profile's)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from .inputs import MethodSpec
from .paths import check_temp_dir
from .problems import Problems
from .quant import QuantRecipe, resolve_quant
from .toolchain import check_compiler, compiler_path, march_rejected

RELEASE_MARCH = "x86-64-v3"


@dataclass(frozen=True)
class CompilerSpec:
    """How the methods are compiled."""

    inductor_options: Mapping[str, Any]  # flattened, every method's
    method_inductor_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # over them, per method
    quant: QuantRecipe | None = None  # None: weights as the module holds them


def resolve_compiler(
    config: Mapping[str, Any], methods: list[MethodSpec], problems: Problems, probe: bool = True
) -> CompilerSpec:
    """The `toolchain`, `quant` and `inductor` groups, every problem added to
    `problems`; `probe`: the compiler is run (probe_compiler) here too."""
    cxx = config["toolchain"]["cxx"]
    for where, options in inductor_option_sets(config):
        if "cpp.cxx" in options:  # one place chooses the compiler: checked, keyed as the toolchain, allow-listed
            why = "the C++ compiler is chosen by toolchain.cxx (checked, keyed as the toolchain): set toolchain.cxx=..."
            problems.append(ConfigError(f"{where}.cpp.cxx", options["cpp.cxx"], why))
    problems.check(check_temp_dir)
    quant = resolve_quant(config["quant"], config["target"]["device"], [m.name for m in methods], problems)
    # The recipe's options first: the inductor group's own win where both set one.
    options = {
        **flatten_options(config["quant"]["inductor"]["options"] or {}),
        **flatten_options(config["inductor"]["options"] or {}),
    }
    if cxx is not None:
        options["cpp.cxx"] = cxx
    options.update(profile_options(config))
    per_method = _method_options(config["quant"]["inductor"].get("methods") or {}, methods, problems, "quant.inductor")
    for name, own in _method_options(config["inductor"].get("methods") or {}, methods, problems).items():
        per_method[name] = {**per_method.get(name, {}), **own}
    if probe:
        probe_compiler(config, options.get("cpp.march"), problems)
    return CompilerSpec(options, per_method, quant)


def probe_compiler(config: Mapping[str, Any], march: Any, problems: Problems) -> None:
    """The compiler a build would call compiles (with the -march it will be
    given). Run where there is work to do: an up-to-date answer compiles
    nothing, and the compiler's identity is in the key already."""
    cxx = config["toolchain"]["cxx"]
    before = len(problems)
    problems.check(check_compiler, cxx)
    if march and len(problems) == before:  # a compiler to ask about -march
        rejected = march_rejected(compiler_path(cxx), str(march))
        if rejected:
            pinned = config["target"].get("march") or config.get("release")
            key = "target.march" if pinned else "inductor.options.cpp.march"
            problems.append(ConfigError(key, march, f"{compiler_path(cxx)} rejects -march={march}: {rejected}"))


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


def inductor_option_sets(config: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Every set of Inductor options a config gives, flattened, by its key."""
    return [(where, flatten_options(options)) for where, options in inductor_option_nodes(config)]


def inductor_option_nodes(config: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """Every set of Inductor options a config gives, as written (nested or
    dotted), by its key: the `inductor` group's and a quant recipe's, each
    for all methods and per method."""
    found: list[tuple[str, Mapping[str, Any]]] = []
    quant = config.get("quant") or {}
    for group, node in (
        ("quant.inductor", quant.get("inductor") if isinstance(quant, Mapping) else None),
        ("inductor", config.get("inductor")),
    ):
        node = _mapping(group, node)
        found.append((f"{group}.options", _mapping(f"{group}.options", node.get("options"))))
        for method, options in _mapping(f"{group}.methods", node.get("methods")).items():
            if isinstance(options, Mapping):
                found.append((f"{group}.methods.{method}", options))
    return found


def _mapping(key: str, node: Any) -> Mapping[str, Any]:
    """A node of Inductor options, or nothing; anything else (a forged
    manifest's list, say) is named, never walked as options."""
    if node is None:
        return {}
    if not isinstance(node, Mapping):
        raise ConfigError(key, node, "expected a mapping of names to values")
    return node


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
    declared: Mapping[str, Any], methods: list[MethodSpec], problems: Problems, where: str = "inductor"
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


# Inductor options that name code Inductor runs or links (a compiler, a
# library, a source tree of kernels): `cpp.cxx` is refused everywhere
# (toolchain.cxx chooses the compiler); these, under an allow-list, only from
# the command line.
CODE_OPTIONS = frozenset(
    {"cuda.cuda_cxx", "cutlass.cutlass_dir", "cuda.cutlass_dir", "xpu.cutlass_dir", "rocm.ck_dir", "rocm.rocm_home",
     "aot_inductor.aoti_shim_library_path"}
)  # fmt: skip
# Inductor's text options that are safe as words: a choice among names, never
# a path or a compiler flag (a text option reaches a compiler's command line:
# `compile_wrapper_opt_level: "O1 -wrapper X"` runs X). Any other text, list or
# mapping value may name code, and is treated as the options above are.
WORD_OPTIONS = {
    "aot_inductor.compile_wrapper_opt_level": r"O[0-3sgz]?|Ofast",
    "cpp.enable_floating_point_contract_flag": r"off|on|fast",
    "cpp.descriptive_names": r"[a-z_]+",
    "triton.descriptive_names": r"[a-z_]+",
    "max_autotune_gemm_backends": r"[A-Za-z0-9_,]+",
    "max_autotune_conv_backends": r"[A-Za-z0-9_,]+",
    "max_autotune_gemm_search_space": r"[A-Za-z0-9_]+",
    "max_autotune_flex_search_space": r"[A-Za-z0-9_]+",
}


def code_options(options: Mapping[str, Any]) -> list[str]:
    """The Inductor options of a flattened set that may name code: those of
    CODE_OPTIONS, and every text, list or mapping value that is not one of
    WORD_OPTIONS' words (booleans and numbers never reach a command line as
    code); `cpp.cxx` aside, which every build refuses itself."""
    found = []
    for name, value in options.items():
        if name.startswith("trace.") and value:  # Inductor's trace writes its files where it runs
            found.append(name)
            continue
        if value is None or isinstance(value, (bool, int, float)) or name == "cpp.cxx":  # refused wherever it is
            continue
        word = WORD_OPTIONS.get(name)
        if name in CODE_OPTIONS or not (isinstance(value, str) and word and re.fullmatch(word, value)):
            found.append(name)
    return sorted(found)
