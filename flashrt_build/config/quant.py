"""A quantization recipe (`quant`), resolved without torch: its schema (the
group's dataclasses, part of schema.py's), its rules, the targets it runs on
and the Inductor options it brings. Applying it to a module is
`stages/quantize.py`."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError

SKIP = "skip"


@dataclass
class QuantMethodConfig:
    """A rule's torchao config for one method alone."""

    config: str = "skip"
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class QuantRuleConfig:
    """One rule of a quantization recipe: the Linear modules whose FQN matches
    `pattern` (fnmatch: `*` any run of characters, `lm_head`, `blocks.*.mlp.*`)
    get torchao's `config` (a class of `torchao.quantization`) built with
    `args`, or stay as they are (`config: skip`). The first rule that matches
    a module decides it."""

    pattern: str = "*"
    config: str = "skip"
    args: dict[str, Any] = field(default_factory=dict)
    # A rule must match some module (a typo would silently quantize what it
    # meant to skip) unless it is optional.
    optional: bool = False
    # Another torchao config for one method's calls, by method name (`prefill:
    # {config: Int8DynamicActivationInt8WeightConfig}`): it must quantize the
    # weights exactly as `config` does (the package binds one copy for all
    # methods) and may differ in what it does to the activations.
    methods: dict[str, QuantMethodConfig] = field(default_factory=dict)


@dataclass
class QuantRecipeInductor:
    """Inductor options a recipe needs to be fast, under the `inductor`
    group's own (which win where both set one)."""

    options: dict[str, Any] = field(default_factory=dict)
    methods: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class QuantConfig:
    """How weights are quantized (torchao), applied to the module after its
    checkpoint is loaded and before export. `none`: not at all."""

    name: str = "none"
    rules: list[QuantRuleConfig] = field(default_factory=list)
    # The target devices the recipe's kernels run on (`cpu`, `cuda`).
    devices: list[str] = field(default_factory=lambda: ["cpu", "cuda"])
    # The least CUDA compute capability it needs ([8, 9]: float8), or null.
    min_capability: list[int] | None = None
    # Verification compares the package with the float module too: a
    # norm-wise relative error ||package - float|| / ||float|| of any output
    # past this fails the build (null: recorded only).
    max_rel_error: float | None = None
    # The package against the quantized module, where the recipe quantizes
    # activations as it runs (dynamic): a compiled kernel's last-bit
    # difference ahead of that can round an activation to the next step.
    # The least rtol verification uses (verify.rtol, when set, wins); null: none.
    rtol: float | None = None
    inductor: QuantRecipeInductor = field(default_factory=QuantRecipeInductor)


@dataclass(frozen=True)
class QuantRule:
    pattern: str  # fnmatch over a Linear module's FQN
    config: str  # a torchao.quantization config class, or `skip`
    args: Mapping[str, Any]
    optional: bool  # may match no module (a recipe shared by models with and without an lm_head)
    key: str  # `quant.rules[i]`, for messages
    # Another torchao config for one method's calls (`prefill`: int8 activations
    # too), over the same quantized weights: a package binds one copy for all.
    methods: Mapping[str, QuantRule] = field(default_factory=dict)

    @property
    def keeps_float(self) -> bool:
        """Does the rule leave its layers' weights float for every method (`skip`)?"""
        return all(rule.config == SKIP for rule in (self, *self.methods.values()))

    def to_json(self) -> dict[str, Any]:
        record = {"pattern": self.pattern, "config": self.config, "args": dict(self.args), "optional": self.optional}
        if self.methods:
            record["methods"] = {name: {"config": r.config, "args": dict(r.args)} for name, r in self.methods.items()}
        return record


@dataclass(frozen=True)
class QuantRecipe:
    name: str
    rules: tuple[QuantRule, ...]
    devices: tuple[str, ...]
    min_capability: tuple[int, int] | None
    max_rel_error: float | None  # refused past it against the float module; None: recorded only

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "rules": [r.to_json() for r in self.rules]}

    def rule_for(self, name: str) -> QuantRule | None:
        """The rule that decides the Linear module `name`: the first whose pattern matches."""
        return next((r for r in self.rules if fnmatch.fnmatchcase(name, r.pattern)), None)


def _check_config(key: str, rule: Mapping[str, Any], problems: list[ConfigError]) -> bool:
    """Is `rule.config` a class name (or `skip`, taking no args)? Each problem added."""
    if not isinstance(rule.get("config"), str) or not rule["config"]:
        problems.append(
            ConfigError(f"{key}.config", rule.get("config"), f"expected a torchao config class name or '{SKIP}'")
        )
        return False
    if rule["config"] == SKIP and rule.get("args"):
        problems.append(ConfigError(f"{key}.args", rule["args"], f"a '{SKIP}' rule takes no args"))
        return False
    return True


def resolve_quant(
    quant: Mapping[str, Any], device: str, methods: list[str], problems: list[ConfigError]
) -> QuantRecipe | None:
    """The recipe `quant` names, checked against the target and the module's
    `methods`; None for `none` (no rules)."""
    rules = []
    for i, rule in enumerate(quant.get("rules") or []):
        key = f"quant.rules[{i}]"
        if not isinstance(rule.get("pattern"), str) or not rule["pattern"]:
            problems.append(ConfigError(f"{key}.pattern", rule.get("pattern"), "expected an fnmatch pattern over FQNs"))
        _check_config(key, rule, problems)
        variants = {}
        for method, variant in (rule.get("methods") or {}).items():
            where = f"{key}.methods.{method}"
            if method not in methods:
                known = ", ".join(methods)
                problems.append(ConfigError(where, dict(variant), f"not a method of this module; its methods: {known}"))
            elif rule.get("config") == SKIP or variant.get("config") == SKIP:
                why = f"a method's config quantizes the rule's weights its own way; neither may be '{SKIP}'"
                problems.append(ConfigError(f"{where}.config", variant.get("config"), why))
            elif _check_config(where, variant, problems):
                variants[method] = QuantRule(
                    rule.get("pattern"), variant["config"], variant.get("args") or {}, True, where
                )
        rules.append(
            QuantRule(
                rule.get("pattern"),
                rule.get("config"),
                rule.get("args") or {},
                bool(rule.get("optional")),
                key,
                variants,
            )
        )
    if not rules:
        return None
    kind = device.split(":")[0]
    devices = tuple(quant.get("devices") or ())
    if kind not in devices:
        problems.append(
            ConfigError(
                "quant",
                quant.get("name"),
                f"the recipe runs on {', '.join(devices) or 'no device'} only (quant.devices); the target is {device}",
            )
        )
    bound = quant.get("max_rel_error")
    if bound is not None and not bound > 0:
        problems.append(ConfigError("quant.max_rel_error", bound, "expected a relative error > 0, or null"))
    capability = quant.get("min_capability")
    if capability is not None and (len(capability) != 2 or not all(isinstance(c, int) for c in capability)):
        problems.append(ConfigError("quant.min_capability", capability, "expected [major, minor], e.g. [8, 9]"))
        capability = None
    return QuantRecipe(
        name=str(quant.get("name")),
        rules=tuple(rules),
        devices=devices,
        min_capability=tuple(capability) if capability else None,
        max_rel_error=bound,
    )
