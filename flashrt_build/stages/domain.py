"""Before the compile: the inputs the config declares against the
eager module. Each input must be a parameter of the method it feeds, and the
method must run on the example and at the edges of what the config promises
(every dynamic dim at its max, every integer input at both ends of its
range): a range the model cannot take (token ids above the vocabulary, a
length beyond its positions) is the config's mistake, named by its key here,
not a crash of the package after a compile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import inspect
import sys
import threading
from collections.abc import Collection, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..config.inputs import MethodSpec
from ..config.problems import raise_all
from ..config.spec import BuildSpec
from ..errors import ConfigError, ExportError, first_lines
from ..runtime.dtypes import INTEGER
from .inputs import ExampleInputs, make_inputs
from .progress import Stage


def inputs_stage(module: torch.nn.Module, spec: BuildSpec, ran: Collection[tuple[str, Any]] = ()) -> Stage[None]:
    """Every method's inputs against the eager module, before the costly
    stages; `ran`: (method, sorted sizes) the eager module ran at already,
    its integer inputs at the ends of their ranges (the reference's calls)."""
    for method in spec.methods:
        check_input_names(module, spec, method)
    notes = [check_input_domain(module, spec, method, ran) for method in spec.methods]
    return Stage(
        None, "; ".join(f"{m.label + ': ' if m.label else ''}{n}" for m, n in zip(spec.methods, notes, strict=True))
    )


def check_input_names(module: torch.nn.Module, spec: BuildSpec, method: MethodSpec) -> None:
    """Every input and constant keyword argument names a parameter of the
    method. Inputs must be named parameters even where the method takes
    `**kwargs` (transformers forwards do: `pixel_value` for `pixel_values`
    would reach the model and be ignored); a constant may go to `**kwargs`."""
    try:
        parameters = inspect.signature(getattr(module, method.attr)).parameters.values()
    except (TypeError, ValueError):  # a builtin or a C extension: nothing to read
        return
    P = inspect.Parameter
    named = {p.name: p for p in parameters if p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD)}
    takes_args = any(p.kind is P.VAR_POSITIONAL for p in parameters)
    takes_kwargs = any(p.kind is P.VAR_KEYWORD for p in parameters)
    by_place = [p.name for p in parameters if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    owner = f"{type(module).__name__}.{method.attr}"
    problems = []
    positional = [inp for inp in method.inputs if inp.positional]
    for place, inp in enumerate(positional):  # passed by place: its name is a label, its count must fit
        if place >= len(by_place) and not takes_args:
            problems.append(
                ConfigError(
                    f"{method.key}.inputs.{inp.name}.positional",
                    True,
                    f"{owner} takes {len(by_place)} positional argument(s) ({', '.join(by_place) or 'none'}); "
                    f"the config passes {len(positional)}",
                )
            )
    for inp in method.inputs:
        if inp.positional:
            continue
        key = f"{method.key}.inputs.{inp.name}"
        parameter = named.get(inp.name)
        if parameter is None:
            problems.append(
                ConfigError(key, inp.name, f"{owner} has no parameter '{inp.name}'{_hint(inp.name, named)}")
            )
        elif parameter.kind is P.POSITIONAL_ONLY:
            problems.append(ConfigError(f"{key}.positional", False, f"{owner} takes '{inp.name}' by position only"))
    for name in method.kwargs:
        if name not in named and not takes_kwargs:
            problems.append(
                ConfigError(
                    f"{method.key}.kwargs.{name}",
                    method.kwargs[name],
                    f"{owner} has no parameter '{name}'{_hint(name, named)}",
                )  # fmt: skip
            )
    raise_all(problems)


def _hint(name: str, named: dict[str, Any]) -> str:
    close = difflib.get_close_matches(name, list(named), n=1)
    return f"; did you mean '{close[0]}'?" if close else f"; its parameters: {', '.join(named) or 'none'}"


def check_input_domain(
    module: torch.nn.Module, spec: BuildSpec, method: MethodSpec, ran: Collection[tuple[str, Any]] = ()
) -> str:
    """Run the eager method at the ends of every declared value range, on the
    example, then with every dynamic dim at its max (unless `ran` holds that
    call); returns what was checked, for the log. A failure is narrowed down
    to the key to blame: one range's end, one dim's max. Buffers the method
    writes are put back after."""
    dims = {d.name: (inp, axis, d) for inp in method.inputs for axis, d in inp.dynamic.items()}
    ranged = [i for i in method.inputs if i.dtype in INTEGER and (i.low is not None or i.high is not None)]
    lows = {i.name: "low" for i in ranged}

    def failure(sizes: dict[str, int] | None = None, edges: dict[str, str] | None = None) -> EagerFailure | None:
        return _eager_failure(module, method, make_inputs(spec, sizes=sizes, method=method, edges=edges))

    with preserved_buffers(module):
        if ranged and failure(edges=lows) is not None and failure(edges={n: "high" for n in lows}) is None:
            for inp in ranged:  # the high ends run: a low end is wrong
                found = failure(edges={**{n: "high" for n in lows}, inp.name: "low"})
                if found is not None:
                    raise _range_error(method, inp, "low", found)
        for inp in ranged:
            found = failure(edges={**lows, inp.name: "high"})
            if found is not None and failure(edges=lows) is None:
                raise _range_error(method, inp, "high", found)
        found = failure()
        if found is not None:
            example = make_inputs(spec, method=method)
            shapes = {name: list(t.shape) for name, t in example.named(method).items()}
            raise ExportError(
                f"the {method.attr} of {spec.target} raises {found.kind} on the example inputs {shapes}, "
                f"without torch.export: {found.said} (check {_suspects(spec, method, found)})"
            )
        at_max = {name: d.max for name, (_, _, d) in dims.items()}
        if dims and (method.name, tuple(sorted(at_max.items()))) in ran:
            return _checked(dims, ranged) + " (at the max: the reference's call)"
        found = failure(at_max, {i.name: "both" for i in ranged})
        if found is None:
            return _checked(dims, ranged)
        for name, (inp, axis, dim) in dims.items():
            alone = failure({name: dim.max}, lows)
            if alone is not None:
                raise ConfigError(
                    f"{method.key}.inputs.{inp.name}.dynamic.{axis}.max",
                    dim.max,
                    f"the eager {method.attr} raises {alone} with '{dim.name}' = {dim.max}; "
                    "lower it to what the model accepts",
                )
        raise ConfigError(
            f"{method.key}.inputs",
            sorted(i.name for i in method.inputs),
            f"the eager {method.attr} raises {found} with every dynamic dim at its max and integer inputs at "
            "the ends of their ranges together, though not with any one alone",
        )


def _range_error(method: MethodSpec, inp: Any, end: str, found: EagerFailure) -> ConfigError:
    value = (inp.high - 1) if end == "high" else (inp.low if inp.low is not None else 0)
    return ConfigError(
        f"{method.key}.inputs.{inp.name}.{end}",
        getattr(inp, end),
        f"the eager {method.attr} raises {found} on the value {value}; declare the values the model "
        f"accepts ({inp.name} in [low, high), high exclusive)",
    )


def _checked(dims: dict[str, Any], ranged: list[Any]) -> str:
    parts = [f"{name} up to {d.max}" for name, (_, _, d) in dims.items()]
    parts += [f"{i.name} in [{i.low if i.low is not None else 0}, {i.high})" for i in ranged]
    return "eager runs " + (", ".join(parts) if parts else "the example")


@dataclasses.dataclass(frozen=True)
class EagerFailure:
    """What an eager call raised, and in which submodule (its FQN; "" when in
    the method's own code)."""

    error: type[BaseException]
    said: str
    where: str = ""
    quantized: bool = False  # the submodule's weight is a quantized tensor

    @property
    def kind(self) -> str:
        return self.error.__name__ + (f" in {self.where}" if self.where else "")

    def __str__(self) -> str:
        return f"{self.kind}: {self.said}"


def _eager_failure(module: torch.nn.Module, method: MethodSpec, example: ExampleInputs) -> EagerFailure | None:
    """None when the eager method runs on `example`, else what it raised and
    where: a forward hook that also runs when forward raises sees each
    exception leave the submodules it passes through, innermost first, so the
    first submodule it left is the one that raised (an exception a model
    catches and handles leaves no trace on the next one)."""
    names = {id(m): name for name, m in module.named_modules() if name}
    raised_in: list[tuple[BaseException, torch.nn.Module]] = []  # each exception and the first submodule it left
    me = threading.get_ident()

    def left(m: torch.nn.Module, args: Any, out: Any) -> None:
        exc = sys.exc_info()[1]  # set while an exception leaves m's forward
        if exc is None or out is not None or threading.get_ident() != me or id(m) not in names:
            return
        if not any(seen is exc for seen, _ in raised_in):
            raised_in.append((exc, m))

    hook = torch.nn.modules.module.register_module_forward_hook(left, always_call=True)
    try:
        with torch.no_grad():
            getattr(module, method.attr)(*example.args, **example.kwargs, **method.kwargs)
    except Exception as exc:
        inner = _raised_in(exc, raised_in)
        weight = getattr(inner, "weight", None)
        return EagerFailure(
            type(exc),
            first_lines(exc, 2),
            names[id(inner)] if inner is not None else "",
            is_traceable_wrapper_subclass(weight),  # False for a plain tensor, None, a non-tensor
        )
    finally:
        hook.remove()
    return None


def _raised_in(exc: BaseException, raised_in: list[tuple[BaseException, torch.nn.Module]]) -> torch.nn.Module | None:
    """The submodule where `exc` began: for `raise ... from cause`, where its
    first cause began (a wrapper's message is not where the fault is);
    None when it began in the method's own code."""
    chain = [exc]
    while chain[-1].__cause__ is not None and len(chain) < 32:
        chain.append(chain[-1].__cause__)
    for error in reversed(chain):
        for seen, m in raised_in:
            if seen is error:
                return m
    return None


def _suspects(spec: BuildSpec, method: MethodSpec, found: EagerFailure) -> str:
    """What to check: the inputs, and the quant recipe where the module runs
    quantized (a quantized layer fails in kernels the float one never ran)."""
    inputs = f"{method.key}.inputs"
    if spec.quant is None:
        return inputs
    if found.quantized:
        pattern = every_block(found.where)
        kept = "it" if pattern == found.where else "it and the same layer of every block"
        return (
            f"{inputs}, or quant '{spec.quant.name}', which quantized {found.where}: a rule "
            f"{{pattern: '{pattern}', config: skip}} before the others keeps {kept} as it was"
        )
    return f"{inputs}, or quant '{spec.quant.name}', which quantized the module before this call"


@contextlib.contextmanager
def preserved_buffers(module: torch.nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """Buffers (a step counter, a KV cache) as they were before the calls
    inside; yields those values, by name."""
    saved = {name: buffer.detach().clone() for name, buffer in module.named_buffers()}
    try:
        yield saved
    finally:
        with torch.no_grad():
            for name, buffer in module.named_buffers():
                buffer.copy_(saved[name])


def every_block(fqn: str) -> str:
    """`fqn` with each block index made a wildcard (`blocks.0.mlp.2` ->
    `blocks.*.mlp.2`): a layer that fails in one block fails in all of them.
    The last part stays, an index there names the layer itself."""
    *path, last = fqn.split(".")
    return ".".join(["*" if part.isdigit() else part for part in path] + [last])
