"""The module objects that builds from an object (`flashrt_build.build(model,
...)`, module_object.py) hand the instantiate stage, by digest: `given`
is such a build's `_target_`, and what the object is keys the build."""

from __future__ import annotations

import contextlib
import contextvars
import copy
import hashlib
import pickle
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError
from ..runtime.dtypes import dtype_name
from ..runtime.hashing import file_sha256
from .preflight import real_name, source_file
from .weights import tensor_sha256

GIVEN = "flashrt_build.stages.objects.given"

# The objects of the builds running in this context, by digest: `given` hands
# the build its copy. A context variable, not a global: two threads' builds
# each see their own.
_objects: contextvars.ContextVar[Mapping[str, torch.nn.Module]] = contextvars.ContextVar("flashrt_objects")


def given(digest: str) -> torch.nn.Module:
    """The `_target_` of a build from an object: a copy of the object
    `build_module` was given, which the build may cast and rewrite."""
    found = _objects.get({}).get(digest)
    if found is None:
        raise ConfigError(
            "module.model.digest",
            digest,
            "names no module object of this process: a build from an object runs where the object is "
            "(flashrt_build.build(model, example_inputs=...)), not from a config or a sweep",
        )
    try:
        return copy.deepcopy(found)
    except Exception as exc:  # noqa: BLE001 - whatever stops the copy: the object is not built in place
        raise ConfigError(
            "model",
            type(found).__name__,
            f"cannot be copied ({type(exc).__name__}: {exc}), and a build rewrites its copy, never your object: "
            "keep what does not copy (a lock, a file, a process handle) off the module",
            "argument",
        ) from None


@contextlib.contextmanager
def handing(digest: str, module: torch.nn.Module) -> Iterator[None]:
    """`given(digest)` hands out copies of `module` inside."""
    token = _objects.set({**_objects.get({}), digest: module})
    try:
        yield
    finally:
        _objects.reset(token)


def object_digest(module: torch.nn.Module, graph: str | None = None) -> tuple[str, str | None]:
    """(digest, None): sha256 of the object's pickle, streamed, each tensor
    by its dtype, shape and contents (a storage pickles by its address,
    another each process), its classes' files and `graph`, what its forward
    computes (`graph_code`: code a pickle names but does not hold, a helper
    it calls, a method patched in, runs there); or (a fresh random name, why)
    where the object does not pickle or its forward does not export."""
    if graph is None:
        return f"unkeyed-{uuid.uuid4().hex}", "its forward did not export here; the build says why"
    digest = hashlib.sha256(graph.encode())

    class Sha256Writer:
        def write(self, data: bytes) -> int:
            digest.update(data)
            return len(data)

    class ByContents(pickle.Pickler):
        def persistent_id(self, obj: Any) -> str | None:
            if not isinstance(obj, torch.Tensor):
                return None
            kind = "parameter" if isinstance(obj, torch.nn.Parameter) else "tensor"
            return f"{kind} {dtype_name(obj.dtype)} {list(obj.shape)} {obj.device.type} {tensor_sha256(obj.detach())}"

    try:
        ByContents(Sha256Writer(), protocol=4).dump(module)
    except Exception as exc:  # noqa: BLE001 - whatever stops pickling stops keying, nothing else
        return f"unkeyed-{uuid.uuid4().hex}", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    for source in class_sources(module):  # a class pickles by name: its code is keyed by its file
        digest.update(f"{source} {file_sha256(Path(source))}".encode())
    return digest.hexdigest(), None


def class_sources(module: torch.nn.Module) -> list[str]:
    """The source files of the classes the object's modules are (and derive
    from), torch's own aside (torch's version keys the build already)."""
    files = set()
    for cls in {c for sub in module.modules() for c in type(sub).__mro__}:
        if cls.__module__.split(".")[0] in ("torch", "builtins"):
            continue
        source = source_file(cls)
        if source:
            files.add(source)
    return sorted(files)


def object_record(digest: str) -> dict[str, Any] | None:
    """The manifest's `module.object`: the class the build's object was, its
    source file and that file's digest, and the object's own digest."""
    found = _objects.get({}).get(digest)
    if found is None:
        return None
    source = source_file(type(found))
    return {
        "class": real_name(type(found)),
        "source_file": source,
        "source_sha256": file_sha256(Path(source)) if source else None,
        "sha256": None if digest.startswith("unkeyed-") else digest,
    }


def graph_code(module: torch.nn.Module, example_inputs: tuple[Any, ...], dynamic_shapes: Any) -> str | None:
    """What the module's forward computes, as torch.export traces it: its
    graph's code and the constants the trace lifted (by contents), or None
    where it does not export (the build's own export then says why)."""
    try:  # on a copy: a forward's Python side effects (a call counter) stay off the user's object
        exported = torch.export.export(
            copy.deepcopy(module), example_inputs, dynamic_shapes=dynamic_shapes, strict=False
        )
    except Exception:  # noqa: BLE001 - the build's stages name the cause
        return None
    constants = sorted(
        f"{name} {tensor_sha256(value.detach())}" if isinstance(value, torch.Tensor) else f"{name} {value!r}"
        for name, value in exported.constants.items()
    )
    return "\n".join([exported.graph_module.code, str(exported.graph_signature), *constants])
