"""Quantize the module's weights by the config's recipe (`quant`),
with torchao, after its checkpoint is loaded and before export.

Each Linear module is decided by the first rule whose pattern matches its
FQN: quantized with that rule's torchao config, or kept (`skip`). The
package then binds each quantized weight as the plain tensors it is made of
(`weights.py`), and verification compares the package with this quantized
module: the compile must add no error of its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..config.problems import Problems, raise_all
from ..config.quant import SKIP, QuantRecipe, QuantRule
from ..config.spec import BuildSpec
from ..errors import ConfigError, first_lines
from ..runtime.dtypes import dtype_name
from .fused import FusedLinear
from .progress import Stage

# String values of config arguments that name torchao objects (YAML has no objects).
GRANULARITIES = {"per_row": "PerRow", "per_tensor": "PerTensor"}


def torchao_version() -> str | None:
    try:
        return importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        return None


def torchao_configs(recipe: QuantRecipe, device: str) -> dict[str, Any]:
    """Each rule's torchao config object by the rule's key, and each of its
    methods' (`quant.rules[1].methods.prefill`); None for `skip`. An unknown
    class, wrong arguments or a GPU that lacks the recipe's kernels are
    ConfigErrors naming the rule's key, before anything is built."""
    try:
        import torchao.quantization as quantization
    except ImportError as exc:
        raise ConfigError(
            "quant",
            recipe.name,
            f"needs torchao, which does not import here ({first_lines(exc, 1)}): pip install torchao",
        ) from None
    problems = Problems()
    if recipe.min_capability is not None and device.startswith("cuda"):
        have = torch.cuda.get_device_capability(torch.device(device))
        if have < recipe.min_capability:
            problems.append(
                ConfigError(
                    "quant",
                    recipe.name,
                    f"needs a GPU of compute capability {'.'.join(map(str, recipe.min_capability))} or later "
                    f"(quant.min_capability); {torch.cuda.get_device_name(torch.device(device))} has "
                    f"{'.'.join(map(str, have))}",
                )
            )
    rules = [one for rule in recipe.rules for one in (rule, *rule.methods.values())]
    configs = {
        rule.key: None if rule.config == SKIP else problems.check(_rule_config, rule, quantization) for rule in rules
    }
    problems.raise_all()
    return configs


def _rule_config(rule: QuantRule, quantization: Any) -> Any:
    """One rule's torchao config object, or the ConfigError naming its key."""
    from torchao.core.config import AOBaseConfig

    cls = getattr(quantization, rule.config, None)
    if not (isinstance(cls, type) and issubclass(cls, AOBaseConfig)):
        known = sorted(n for n in dir(quantization) if n.endswith("Config") and not n.startswith("_"))
        raise ConfigError(
            f"{rule.key}.config",
            rule.config,
            f"not a config of torchao.quantization {torchao_version()} (or '{SKIP}'); it has {', '.join(known)}",
        )
    if "set_inductor_config" in rule.args:
        raise ConfigError(
            f"{rule.key}.args.set_inductor_config",
            rule.args["set_inductor_config"],
            "torchao would set Inductor options for the whole process, unrecorded; flashrt_build turns it off. "
            "Give the options in quant.inductor.options (or .methods.NAME): the manifest records them",
        )
    arguments = _arguments(rule.args, quantization)
    if dataclasses.is_dataclass(cls) and "set_inductor_config" in {f.name for f in dataclasses.fields(cls)}:
        arguments["set_inductor_config"] = False  # its options are the recipe's, explicit and recorded
    try:
        return cls(**arguments)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{rule.key}.args", dict(rule.args), f"{rule.config}: {first_lines(exc, 1)}") from None


def _arguments(args: Mapping[str, Any], quantization: Any) -> dict[str, Any]:
    """`granularity: per_row` is torchao's `PerRow()`."""
    return {
        key: getattr(quantization, GRANULARITIES[value])()
        if key == "granularity" and isinstance(value, str) and value in GRANULARITIES
        else value
        for key, value in args.items()
    }


def rules_for(module: torch.nn.Module, recipe: QuantRecipe, target: str) -> dict[str, QuantRule]:
    """Each Linear module's FQN and the rule that decides it (the first that
    matches). A layer the `fuse_projections` pass made is decided by its
    members' names, as they would have been: the pass fuses only layers one
    rule decides. A rule that decides nothing is an error unless optional: a
    mistyped pattern would quietly quantize what it meant to keep."""
    linears = {name: m for name, m in module.named_modules() if isinstance(m, torch.nn.Linear)}
    decided: dict[str, QuantRule] = {}
    for name, layer in linears.items():
        rules = [recipe.rule_for(member) for member in members(name, layer)]
        rule = rules[0]
        assert all(r is rule for r in rules), f"{name}: its members are decided by different rules"
        if rule is not None:
            decided[name] = rule
    idle = [r for r in recipe.rules if not r.optional and r not in decided.values()]
    names = [member for name, layer in linears.items() for member in members(name, layer)]
    raise_all(
        [
            ConfigError(
                f"{r.key}.pattern",
                r.pattern,
                f"decides no Linear module of {target} (matched by none, or each by an earlier rule); "
                f"its Linear modules: {', '.join(names[:6]) or 'none'}{' ...' if len(names) > 6 else ''}",
            )
            for r in idle
        ]
    )
    return decided


def members(name: str, layer: torch.nn.Module) -> tuple[str, ...]:
    """The names a recipe's rules match a Linear module by: its own, or a fused layer's members'."""
    return layer.members if isinstance(layer, FusedLinear) else (name,)


def rows_kept_apart(config: Any, rows: list[int], like: torch.Tensor) -> str | None:
    """None when quantizing the weights of layers of these row counts as one
    tensor gives each layer's rows exactly as quantizing it alone (a scale
    per row, or per group of a row); otherwise why not (one scale for the
    whole tensor). Probed on weights of `like`'s input size, dtype and device,
    each layer's of its own magnitude, read back through the quantized matmul."""
    from torchao.quantization import quantize_

    generator = torch.Generator(like.device).manual_seed(0)
    parts = [
        torch.randn(min(count, 128), like.shape[1], generator=generator, device=like.device, dtype=like.dtype) * 8.0**i
        for i, count in enumerate(rows)
    ]

    def read_back(weight: torch.Tensor) -> torch.Tensor:
        layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=like.device, dtype=like.dtype)
        layer.weight = torch.nn.Parameter(weight, requires_grad=False)
        quantize_(layer, config)
        with torch.no_grad():
            return layer(torch.eye(weight.shape[1], device=like.device, dtype=like.dtype))

    try:
        together, apart = read_back(torch.cat(parts)), torch.cat([read_back(part) for part in parts], dim=-1)
    except Exception as exc:  # quantizing is the quantize stage's to fail, naming its rule; here: not fused
        return f"the probe failed: {first_lines(exc, 1)}"
    if not torch.equal(together, apart):
        return f"{type(config).__name__} would share scales across the layers: quantized as one, their rows change"
    return None


# A method's own weights (a rule's `methods`), by method name and module FQN.
MethodWeights = Mapping[str, Mapping[str, torch.nn.Parameter]]


@dataclass(frozen=True)
class Quantized:
    """What quantizing changed in a module, by module FQN: the float weights
    it replaced (verification measures the error against them), and the
    weights a method calls instead of the recipe's (its rule's `methods`),
    made of the very same tensors."""

    originals: Mapping[str, torch.nn.Parameter]
    methods: MethodWeights


def quantize_stage(module: torch.nn.Module, spec: BuildSpec) -> Stage[Quantized]:
    """Quantize `module` in place by `spec.quant`; the manifest's `quant` section."""
    from torchao.quantization import quantize_

    recipe = spec.quant
    assert recipe is not None
    configs = torchao_configs(recipe, spec.device)
    decided = rules_for(module, recipe, spec.target)
    originals = {name: _weight(module, name) for name, r in decided.items() if r.config != SKIP}
    section = {
        **recipe.to_json(),
        "torchao": torchao_version(),
        # each Linear's rule, and its float weight as a checkpoint holds it (what `check` compares)
        "modules": {name: _record(module, name, recipe.rules.index(rule), rule) for name, rule in decided.items()},
    }
    for rule in recipe.rules:
        chosen = {name for name, r in decided.items() if r is rule}
        if configs[rule.key] is not None and chosen:
            quantize_(module, configs[rule.key], filter_fn=lambda _, fqn, chosen=chosen: fqn in chosen)
    methods: dict[str, dict[str, torch.nn.Parameter]] = {}
    for name, rule in decided.items():
        for method, variant in rule.methods.items():
            own = same_tensors(_weight(module, name), originals[name], configs[variant.key], variant, rule)
            methods.setdefault(method, {})[name] = own
    note = f"{recipe.name}: {len(originals)} Linear modules quantized, {len(decided) - len(originals)} kept"
    if methods:
        note += "; " + ", ".join(f"{m}: {len(own)} called by its own config" for m, own in methods.items())
    return Stage(Quantized(originals, methods), note, {"quant": section})


def same_tensors(
    weight: Any, original: torch.Tensor, config: Any, variant: QuantRule, rule: QuantRule
) -> torch.nn.Parameter:
    """`original` quantized by a method's own config, made of `weight`'s
    tensors (one copy bound for every method): its parts must equal them,
    or the method's config is refused naming its key."""
    from torchao.quantization import quantize_

    probe = torch.nn.Linear(original.shape[1], original.shape[0], bias=False, device=original.device)
    probe.weight = torch.nn.Parameter(original.detach(), requires_grad=False)
    quantize_(probe, config)
    own: Any = probe.weight  # a torchao tensor subclass
    names, meta = own.__tensor_flatten__()
    theirs: Sequence[str] = weight.__tensor_flatten__()[0] if is_traceable_wrapper_subclass(weight) else []
    differ = [n for n in names if n not in theirs or not torch.equal(getattr(own, n), getattr(weight, n))]
    if type(own) is not type(weight) or differ:
        raise ConfigError(
            f"{variant.key}.config",
            variant.config,
            f"quantizes the weights otherwise than the rule's {rule.config} ({type(own).__name__}, "
            f"{', '.join(differ) or 'its parts'} differ): a package binds one copy of each weight for all its "
            "methods, so a method's config may change only what it does to the activations",
        )
    subclass: Any = type(own)
    shared = subclass.__tensor_unflatten__({n: getattr(weight, n) for n in names}, meta, own.size(), own.stride())
    return torch.nn.Parameter(shared, requires_grad=False)


def _record(module: torch.nn.Module, name: str, index: int, rule: QuantRule) -> dict[str, Any]:
    """The manifest's entry of one Linear module: its rule, its float weight's
    shape and dtype, and a fused layer's members (the checkpoint names them)."""
    layer, weight = module.get_submodule(name), _weight(module, name)
    record = {"rule": index, "config": rule.config, "shape": list(weight.shape), "dtype": dtype_name(weight.dtype)}
    if isinstance(layer, FusedLinear):
        record["fused_from"] = list(layer.members)
    return record


def _weight(module: torch.nn.Module, name: str) -> torch.nn.Parameter:
    return cast(torch.nn.Parameter, module.get_submodule(name).weight)


@contextlib.contextmanager
def swapped_weights(module: torch.nn.Module, weights: Mapping[str, torch.nn.Parameter]) -> Iterator[None]:
    """The module with these weights (by module FQN) in place of its own, for
    the length of the block: the float ones it had before quantization, or a
    method's own."""
    own = {name: _weight(module, name) for name in weights}
    try:
        for name, weight in weights.items():
            module.get_submodule(name).weight = weight
        yield
    finally:
        for name, weight in own.items():
            module.get_submodule(name).weight = weight
