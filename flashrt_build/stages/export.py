"""The export: the module captured as one graph per method with torch.export.

A graph break or any export failure is an error naming the module target and
torch's reason. There is no fallback to a partial graph or to eager.

A module that mutates its buffers in forward (a step counter, running
statistics, a KV cache) keeps them as the package's state. In place (the
default, `serve.state`): the graph is exported as it is and the compiled code
writes the buffers it binds, which the loader binds to one shared set of
tensors, so nothing is copied and what one method writes the next reads.
Threaded: the state is an explicit input and output of the graph, copied in
and back on every call.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..artifact import STATE_KWARG
from ..config.inputs import MethodSpec
from ..config.schema import StateMode
from ..config.spec import BuildSpec
from ..errors import ExportError, first_lines
from .custom_ops import resolve_custom_ops, triton_calls
from .experts import RUNNABLE, runnable_experts
from .exporting import exporting
from .exporting import is_exporting as is_exporting  # where it was first: flashrt_build.stages.export.is_exporting
from .inputs import ExampleInputs, dynamic_shapes, make_inputs
from .int8_matmul import pad_int8_matmuls
from .progress import Stage
from .quantize import MethodWeights, swapped_weights
from .rewrites import enabled_rewrites, rewrites_note
from .weights import quantized_parts

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _exporting_flag() -> Iterator[None]:
    # On a failed guard, symbolic_shapes logs whole graph dumps as warnings;
    # the ExportError already carries the reason.
    shapes_log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = shapes_log.level
    shapes_log.setLevel(logging.ERROR)
    try:
        with exporting():
            yield
    finally:
        shapes_log.setLevel(level)


# The wrapper's attribute holding the user's module when its state is threaded:
# that package's FQNs start with it.
WRAPPED = "module"


@contextlib.contextmanager
def calling(module: torch.nn.Module, method: MethodSpec) -> Iterator[None]:
    """While inside, `module.forward` is the method to export with its
    constant keyword arguments bound, taking only the tensor inputs. torch.export
    traces forward, so the weights keep their own names; and a constant among
    its inputs (`return_dict=False`) would need a dynamic-shape spec of its own."""
    if method.attr == "forward" and not method.kwargs:
        yield
        return
    bound, constants = getattr(module, method.attr), dict(method.kwargs)

    def forward(*args: Any, **kwargs: Any) -> Any:
        return bound(*args, **kwargs, **constants)

    P = inspect.Parameter
    forward.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [P(i.name, P.POSITIONAL_OR_KEYWORD) for i in method.positional]
        + [P(i.name, P.KEYWORD_ONLY) for i in method.keyword]
    )
    own = module.__dict__.get("forward")
    module.forward = forward
    try:
        yield
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own


class ThreadedState(torch.nn.Module):
    """Runs `module` with the given buffers in place of its own and returns
    their new values: state in, state out, nothing mutated inside the graph.
    A wrapper, not the module itself: reparametrising the root module that
    torch.export traces breaks its functionalisation of `self.steps += 1`."""

    def __init__(self, module: torch.nn.Module, names: list[str]) -> None:
        super().__init__()
        setattr(self, WRAPPED, module)
        self.names = names

    def forward(self, *args: Any, **kwargs: Any) -> tuple[Any, dict[str, torch.Tensor]]:
        state = {name: tensor.clone() for name, tensor in kwargs.pop(STATE_KWARG).items()}
        out = torch.func.functional_call(getattr(self, WRAPPED), state, args, kwargs, strict=False)
        return out, {name: state[name] for name in self.names}


def threaded(module: torch.nn.Module, names: list[str], positional: list[str], keyword: list[str]) -> ThreadedState:
    """A ThreadedState whose forward has the module's input names as its
    signature, which torch.export needs to match dynamic shapes to inputs."""

    def forward(self: ThreadedState, *args: Any, **kwargs: Any) -> Any:
        return ThreadedState.forward(self, *args, **kwargs)

    P = inspect.Parameter
    forward.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [P("self", P.POSITIONAL_OR_KEYWORD)]
        + [P(n, P.POSITIONAL_OR_KEYWORD) for n in positional]
        + [P(n, P.KEYWORD_ONLY) for n in [*keyword, STATE_KWARG]]
    )
    cls = type("ThreadedState", (ThreadedState,), {"forward": forward})
    return cls(module, names)


@dataclass
class Exported:
    """One method's exported program and, for a stateful one, the buffers it
    writes: in place, or threaded through the call as inputs and outputs."""

    method: MethodSpec
    program: torch.export.ExportedProgram
    state: list[str] = field(default_factory=list)
    threaded: bool = False
    # A quantized weight's plain parts, by name: (the weight, its attribute),
    # as export made them (a decomposition unwraps them nameless of that).
    parts: dict[str, tuple[str, str]] = field(default_factory=dict)

    @property
    def prefix(self) -> str:
        """What the package's FQNs start with, relative to the user's module."""
        return f"{WRAPPED}." if self.threaded else ""


def export_stage(
    module: torch.nn.Module, spec: BuildSpec, method_weights: MethodWeights | None = None
) -> Stage[list[Exported]]:
    """Every method exported on its own: its example inputs, then torch.export;
    `method_weights`: a method's own weights (by module FQN) in place of the module's."""
    exported = []
    decomposed: list[str] = []
    libraries: dict[str, list[str]] = {}
    padded = 0
    rewrites = enabled_rewrites(spec)
    done: dict[str, dict[str, dict[str, int]]] = {rewrite.name: {} for rewrite in rewrites}  # by pass, by method
    experts = runnable_experts(module)
    for method in spec.methods:
        example = make_inputs(spec, method=method)
        with swapped_weights(module, (method_weights or {}).get(method.name, {})):
            one = export_module(module, spec, example, dynamic_shapes(spec, example, method), method)
        one.parts = quantized_parts(one.program)
        # before any compile: each custom operator runs without Python, or the build stops here
        one.program, python, compiled = resolve_custom_ops(one.program, spec.target, method.label)
        one.program, count = pad_int8_matmuls(one.program, spec.device)
        padded += count
        for rewrite in rewrites:
            if took := rewrite.run(one.program):
                done[rewrite.name][method.name] = took
        decomposed += [op for op in python if op not in decomposed]
        for path, ops in compiled.items():
            libraries.setdefault(path, []).extend(op for op in ops if op not in libraries.get(path, []))
        exported.append(one)
    note = ", ".join(
        f"{e.method.label + ': ' if e.method.label else ''}{len(e.program.graph.nodes)} graph nodes"
        + "".join(f", {count} {op} calls (Triton, compiled in)" for op, count in triton_calls(e.program).items())
        + (f", state {'threaded' if e.threaded else 'in place'}: {', '.join(e.state)}" if e.state else "")
        for e in exported
    )
    if decomposed:
        note += f"; decomposed {', '.join(decomposed)} (Python-only custom operators)"
    if padded:
        note += f"; {padded} int8 matmuls given 16 rows more (cuBLAS takes more than 16)"
    note += rewrites_note(done)
    if experts:
        note += f"; {experts} mixture-of-experts model(s) run their experts as {RUNNABLE} (grouped_mm is Python-only)"
    sections = {
        "experts": {"implementation": RUNNABLE, "models": experts} if experts else {},
        "libraries": [{"path": path, "ops": ops} for path, ops in libraries.items()],
        "rewrites": {name: {"methods": by_method} for name, by_method in done.items()},  # the manifest's passes.*
    }
    return Stage(exported, note, {k: v for k, v in sections.items() if v})


def export_module(
    module: torch.nn.Module,
    spec: BuildSpec,
    example: ExampleInputs,
    dynamic_shapes: object,
    method: MethodSpec | None = None,
) -> Exported:
    """`torch.export.export` of one method (the default one unless given) with
    its dynamic shapes, errors made plain and naming the method."""
    method = method or spec.default_method
    with calling(module, method):
        program = _export(module, spec, method, example.args, example.kwargs, dynamic_shapes)
    mutated = mutated_buffers(program, spec)
    if not mutated or spec.state_mode is StateMode.in_place:
        return Exported(method, program, mutated)
    where = f"{method.name}: " if method.label else ""
    log.info("%sthreading mutated buffers through the package as explicit state: %s", where, ", ".join(mutated))
    state = {name: module.get_buffer(name) for name in mutated}
    kwargs = {**example.kwargs, STATE_KWARG: state}
    positional = [i.name for i in method.positional]
    wrapper = threaded(module, mutated, positional, list(example.kwargs))
    # torch.export maps dynamic shapes through the wrapper's named signature.
    combined = example.named(method)
    shapes = {name: _shape_of(dynamic_shapes, value) for name, value in combined.items()}
    shapes[STATE_KWARG] = dict.fromkeys(mutated)
    with calling(module, method):  # the wrapped module's forward is the method
        program = _export(wrapper, spec, method, example.args, kwargs, shapes)
    left = mutated_buffers(program, spec)
    if left:
        raise ExportError(f"{spec.target} still mutates buffers {left} after threading them as state")
    return Exported(method, program, mutated, threaded=True)


def _shape_of(shapes: Any, value: Any) -> Any:
    """A tensor's entry in a ShapesCollection, without adding one."""
    return shapes._shapes.get(id(value)) if isinstance(value, torch.Tensor) else None


def mutated_buffers(program: torch.export.ExportedProgram, spec: BuildSpec) -> list[str]:
    """Buffers the forward writes: functionalisation lists them as mutation outputs."""
    try:
        functional = program.run_decompositions({})
    except Exception as exc:
        raise ExportError(f"could not functionalise the graph of {spec.target}: {first_lines(exc)}") from exc
    return sorted(set(functional.graph_signature.buffers_to_mutate.values()))


def _export(
    module: torch.nn.Module,
    spec: BuildSpec,
    method: MethodSpec,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    dynamic_shapes: object,
) -> torch.export.ExportedProgram:
    # A failed export prints its partial graph to stderr; keep it at debug
    # level instead of burying the one-line error under it.
    printed = io.StringIO()
    try:
        with _exporting_flag(), torch.no_grad(), contextlib.redirect_stderr(printed):
            return torch.export.export(module, args, kwargs, dynamic_shapes=dynamic_shapes)
    except Exception as exc:
        log.debug("torch.export printed:\n%s", printed.getvalue())
        where = _user_frame(printed.getvalue())
        what = f"{spec.target} method {method.name}" if method.label else spec.target
        raise ExportError(
            f"torch.export could not capture {what} as one graph"
            f"{f' at {where}' if where else ''} ({type(exc).__name__}): {first_lines(exc, 4)}"
        ) from exc


def _user_frame(partial_graph: str) -> str | None:
    """The last source line the partial graph reached: where tracing stopped."""
    frames = re.findall(r"# File: (.+?), code: (.+)", partial_graph)
    return f"{frames[-1][0]}: `{frames[-1][1].strip()}`" if frames else None
