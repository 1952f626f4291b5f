"""A quantization recipe (`quant`), resolved without torch: its rules, the
targets it runs on and the Inductor options it brings. Applying it to a
module is `stages/quantize.py`."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

SKIP = "skip"


@dataclass(frozen=True)
class QuantRule:
    pattern: str  # fnmatch over a Linear module's FQN
    config: str  # a torchao.quantization config class, or `skip`
    args: Mapping[str, Any]
    optional: bool  # may match no module (a recipe shared by models with and without an lm_head)
    key: str  # `quant.rules[i]`, for messages

    def to_json(self) -> dict[str, Any]:
        return {"pattern": self.pattern, "config": self.config, "args": dict(self.args), "optional": self.optional}


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


def resolve_quant(quant: Mapping[str, Any], device: str, problems: list[ConfigError]) -> QuantRecipe | None:
    """The recipe `quant` names, checked against the target; None for `none`
    (no rules)."""
    rules = []
    for i, rule in enumerate(quant.get("rules") or []):
        key = f"quant.rules[{i}]"
        if not isinstance(rule.get("pattern"), str) or not rule["pattern"]:
            problems.append(ConfigError(f"{key}.pattern", rule.get("pattern"), "expected an fnmatch pattern over FQNs"))
        if not isinstance(rule.get("config"), str) or not rule["config"]:
            problems.append(
                ConfigError(f"{key}.config", rule.get("config"), f"expected a torchao config class name or '{SKIP}'")
            )
        elif rule["config"] == SKIP and rule.get("args"):
            problems.append(ConfigError(f"{key}.args", rule["args"], f"a '{SKIP}' rule takes no args"))
        rules.append(
            QuantRule(rule.get("pattern"), rule.get("config"), rule.get("args") or {}, bool(rule.get("optional")), key)
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
