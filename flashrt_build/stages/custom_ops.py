"""Custom operators in an exported graph, found before the compile. A package
runs without Python, so each operator outside torch's own namespaces must
have a compiled kernel:

- a C++ kernel stays: the shared library that registers it is recorded in the
  manifest (`libraries`) and loaded before the package, by `load` and by the
  C++ library;
- a Triton operator (`torch.library.triton_op`, the `gemv` pass's) stays:
  AOTInductor compiles its kernels into the package;
- a Python-only operator (`torch.library.custom_op`) is decomposed into the
  operators its Python implementation calls, when that traces;
- otherwise the build stops here, naming the operator and what to do, instead
  of compiling a package whose loader refuses it.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..errors import ExportError, first_lines

# Namespaces of torch's own operators, which every package loader runs or
# Inductor lowers away (`export::access_subclass_inner_tensor`, a quantized
# weight's parts).
TORCH_NAMESPACES = frozenset(
    {"aten", "prims", "prim", "export", "inductor", "quantized", "_quantized", "_c10d_functional",
     "c10d_functional", "higher_order", "profiler", "debugprims"}
)  # fmt: skip


def custom_operators(program: torch.export.ExportedProgram) -> list[torch._ops.OpOverload]:
    """The operators outside torch's namespaces a graph calls, in order of
    first use, but for Triton operators (compiled into the package)."""
    found: dict[str, torch._ops.OpOverload] = {}
    for op in _called_ops(program):
        if op.namespace not in TORCH_NAMESPACES and not triton_operator(op):
            found.setdefault(op.name(), op)
    return list(found.values())


def triton_calls(program: torch.export.ExportedProgram) -> dict[str, int]:
    """How many times the graph calls each Triton operator."""
    return dict(Counter(op.name() for op in _called_ops(program) if triton_operator(op)))


def _called_ops(program: torch.export.ExportedProgram) -> Iterator[torch._ops.OpOverload]:
    """The operator of each call in the graph, in order (one per call)."""
    for node in program.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            yield node.target


def triton_operator(op: torch._ops.OpOverload) -> bool:
    """Is the operator a `triton_op`, whose kernels Inductor compiles into the package?"""
    from torch._library.triton import triton_ops_to_kernels

    return op._schema.name in triton_ops_to_kernels


def python_only(op: torch._ops.OpOverload) -> bool:
    """Is the operator's kernel Python (a `custom_op`, or registered from a .py file)?"""
    from torch._library.custom_ops import OPDEFS

    if op.name().split(".")[0] in OPDEFS:
        return True
    dump = torch._C._dispatch_dump(op.name().split(".")[0])
    kernels = re.findall(r"^(?:CPU|CUDA|Composite\w*)[^:]*: registered at (\S+)", dump, flags=re.M)
    return bool(kernels) and all(where.split(":")[0].endswith(".py") for where in kernels)


def resolve_custom_ops(
    program: torch.export.ExportedProgram, target: str, method: str | None = None
) -> tuple[torch.export.ExportedProgram, list[str], dict[str, list[str]]]:
    """The program with its Python-only operators decomposed, the operators
    decomposed, and the C++ ones by the library that registers them."""
    where = f"{target} method {method}" if method else target
    ops = custom_operators(program)
    python = [op for op in ops if python_only(op)]
    if python:
        table = {op: _python_implementation(op, where) for op in python}
        try:
            program = program.run_decompositions(table)
        except Exception as exc:
            names = ", ".join(op.name() for op in python)
            experts = any(op.namespace == "transformers" for op in python)
            hint = (
                " (transformers' mixture-of-experts layers: build with +module=causal_lm, or call the model's "
                "set_experts_implementation('batched_mm') in your factory)"
                if experts
                else ""
            )
            raise ExportError(
                f"the graph of {where} calls {names}, a custom operator with only a Python implementation, "
                f"which a package cannot run (it loads no Python), and whose implementation does not trace "
                f"({type(exc).__name__}: {first_lines(exc, 1)}); give it a C++ kernel (torch.library in a compiled "
                f"library) or a traceable implementation, or keep the model from calling it{hint}"
            ) from exc
        left = [op for op in custom_operators(program) if python_only(op)]
        if left:
            raise ExportError(f"the graph of {where} still calls {left[0].name()} after its decomposition")
    libraries: dict[str, list[str]] = {}
    for op in custom_operators(program):
        library = library_of(op)
        if library is None:
            raise ExportError(
                f"the graph of {where} calls {op.name()}, whose C++ kernel comes from no shared library this "
                "process loaded that flashrt_build can name (torch.ops.load_library, or a Python package of its "
                "namespace's name); a package could not load it elsewhere"
            )
        libraries.setdefault(library, []).append(op.name())
    return program, [op.name() for op in python], libraries


def _python_implementation(op: torch._ops.OpOverload, where: str) -> Any:
    from torch._library.custom_ops import OPDEFS

    definition = OPDEFS.get(op.name().split(".")[0])
    if definition is not None:
        return definition._init_fn
    from torch._inductor.decomposition import decompositions

    if op in decompositions:  # kept whole through export for Inductor to decompose (torchao's primitives)
        return decompositions[op]
    raise ExportError(
        f"the graph of {where} calls {op.name()}, a custom operator registered from Python, which a package "
        "cannot run: give it a C++ kernel (torch.library in a compiled library), or keep the model from "
        "calling it"
    )


def library_of(op: torch._ops.OpOverload) -> str | None:
    """The shared library that registered an operator: one loaded with
    torch.ops.load_library, or a compiled extension of the Python package of
    its namespace's name (torchvision's), that this process has mapped and
    whose bytes name the namespace and the operator."""
    mapped = _mapped_libraries()
    candidates = [path for path in sorted(torch.ops.loaded_libraries) if path in mapped]
    package_file = getattr(sys.modules.get(op.namespace), "__file__", None)
    if package_file:
        folder = Path(package_file).parent
        candidates += [path for path in sorted(mapped) if Path(path).parent == folder and ".so" in Path(path).name]
    # The library's bytes hold the namespace (its TORCH_LIBRARY) and the operator's schema.
    namespace, name = op.namespace.encode(), op.name().split("::")[1].split(".")[0].encode()
    for path in candidates:
        data = Path(path).read_bytes()
        if namespace in data and name in data:
            return path
    return None


def _mapped_libraries() -> set[str]:
    """Every shared object mapped into this process (Linux /proc/self/maps)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return set(torch.ops.loaded_libraries)
    return {line.split()[-1] for line in lines if ".so" in line.split()[-1]}
