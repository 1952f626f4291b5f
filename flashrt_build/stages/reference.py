"""The reference a package is verified against: the eager module as the
user gave it, run over the verification's calls right after it is
instantiated, before any pass or `quant` recipe rewrote it. A pass that
changes the answer then fails verification instead of verifying against
its own rewrite.

The module's buffers are put back after the run, so the passes, the export
and the package's initial state see the module as it was built."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..config.spec import BuildSpec
from ..errors import VerifyError, first_lines
from ..runtime.dtypes import INTEGER
from .domain import preserved_buffers
from .inputs import make_inputs
from .progress import Stage
from .quantize import Quantized, swapped_weights
from .verify_process import Call


@dataclass
class Reference:
    """The calls of the verification sequence and what the module as given
    returned for each; `changed`: the buffers those calls changed (a step
    counter, a KV cache), as they were after the last call."""

    calls: list[Call]
    outputs: list[Any] = field(default_factory=list)
    changed: dict[str, torch.Tensor] = field(default_factory=dict)
    # The eager module raised on a call: raised once the config's inputs are
    # checked (domain.py), which names a config mistake behind it by its key.
    failure: VerifyError | None = None

    def ran_at_edges(self) -> set[tuple[str, tuple[tuple[str, int], ...]]]:
        """(method, sizes) of the calls the module ran with every dynamic dim
        at its max and its integer inputs at both ends of their ranges: what
        the inputs stage need not run again."""
        if self.failure is not None:
            return set()

        def at_max(call: Call) -> bool:
            dims = {d.name: d.max for inp in call.method.inputs for d in inp.dynamic.values()}
            return bool(dims) and call.sizes == dims

        return {(c.method.name, tuple(sorted(c.sizes.items()))) for c in self.calls if at_max(c)}

    def state(self, names: list[str], module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The value each state buffer must hold after the sequence: the one
        the module as given ended with; a buffer it did not change, or one a
        pass added (a scratch count), ends as it began, as `module` holds it now."""
        return {
            name: self.changed[name] if name in self.changed else module.get_buffer(name).detach().cpu().clone()
            for name in names
        }


def reference_stage(module: torch.nn.Module, spec: BuildSpec) -> Stage[Reference]:
    """Run the module as given over the verification sequence; the outputs
    are kept on the host until the package's are compared with them."""
    reference = Reference(plan_calls(spec, spec.repeat))
    with preserved_buffers(module) as initial:
        try:
            reference.outputs, _ = run_eager(module, spec, reference.calls, [])
        except VerifyError as exc:
            reference.failure = exc
            return Stage(reference, "the eager module raised: said after the inputs are checked")
        reference.changed = {
            name: buffer.detach().cpu().clone()
            for name, buffer in module.named_buffers()
            if not torch.equal(buffer, initial[name])
        }
    return Stage(reference, f"{len(reference.calls)} eager calls of the module as given")


def plan_calls(spec: BuildSpec, repeat: int) -> list[Call]:
    """For each method: the example, each dim at min / an odd size between /
    max (where every dim is then at its max, the integer inputs at both ends
    of their ranges: the inputs stage's costliest check, run once). Then a
    chain: a lone forward `repeat` more times; several methods each once in
    the order listed, then the last one `repeat` more times, the way a user
    calls them (prefill, then decode steps)."""
    calls = []
    for method in spec.methods:
        probes: list[dict[str, int]] = [{}]
        dims = {d.name: d for inp in method.inputs for d in inp.dynamic.values()}
        for dim in dims.values():
            for size in (dim.min, _odd_between(dim.min, dim.max), dim.max):
                if size is not None and {dim.name: size} not in probes:
                    probes.append({dim.name: size})
        prefix = f"{method.name}: " if method.label else ""
        at_max = {d.name: d.max for d in dims.values()}
        edges = {i.name: "both" for i in method.inputs if i.dtype in INTEGER and (i.low, i.high) != (None, None)}
        calls += [
            Call(prefix + _label(sizes), sizes, {}, method, edges if dims and sizes == at_max else {})
            for sizes in probes
        ]
    if spec.multi_method:
        chain = [*spec.methods, *[spec.methods[-1]] * repeat]
        calls += [Call(f"chain {i + 1}: {m.name}", {}, {}, m) for i, m in enumerate(chain)]
    else:
        calls += [Call(f"repeat {i + 1}", {}, {}, spec.default_method) for i in range(repeat)]
    for i, call in enumerate(calls):
        example = make_inputs(spec, seed=spec.seed + 1 + i, sizes=call.sizes, method=call.method, edges=call.edges)
        call.inputs = example.named(call.method)
    return calls


def _odd_between(lo: int, hi: int) -> int | None:
    mid = (lo + hi) // 2
    mid = mid if mid % 2 else mid + 1
    return mid if lo < mid < hi else None


def _label(sizes: Mapping[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sizes.items()) or "example"


def run_eager(
    module: torch.nn.Module, spec: BuildSpec, calls: list[Call], state: list[str], quantized: Quantized | None = None
) -> tuple[list[Any], dict]:
    """The reference outputs of the sequence, and the module's state after it;
    each call with its method's own weights where a recipe gives it some."""
    outputs = []
    with torch.no_grad():
        for call in calls:
            method = call.method
            # copies: a module that writes into its input must not change what the package is given
            args, kwargs = method.call_args({name: value.clone() for name, value in call.inputs.items()})
            try:
                with swapped_weights(module, quantized.methods.get(method.name, {}) if quantized else {}):
                    out = getattr(module, method.attr)(*args, **kwargs, **method.kwargs)
            except Exception as exc:
                raise VerifyError(
                    f"the eager {method.attr} of {spec.target} raised {type(exc).__name__} at call '{call.label}', "
                    f"so there is nothing to compare the package with: {first_lines(exc, 2)}"
                ) from exc
            outputs.append(
                pytree.tree_map(lambda t: t.detach().cpu().clone() if isinstance(t, torch.Tensor) else t, out)
            )
    return outputs, {name: module.get_buffer(name).detach().cpu().clone() for name in state}
