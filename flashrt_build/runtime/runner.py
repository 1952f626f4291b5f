"""A package's models loaded into this process: the libraries of the custom
operators it calls first (as the build recorded them), then torch's runner
for each model, and the types its outputs are made of imported, so pytree
can rebuild them."""

from __future__ import annotations

import contextlib
import importlib
import re
import sys
from pathlib import Path
from typing import Any

import torch

from ..artifact import SINGLE_MODEL
from ..errors import ArtifactError
from .tempdir import check_temp_dir


def load_libraries(manifest: dict[str, Any]) -> None:
    """Register the custom operators the package calls: each shared library
    the build recorded, unless its operators are registered already."""
    for library in manifest.get("libraries") or []:
        if all(_registered(op) for op in library["ops"]):
            continue
        if not Path(library["path"]).is_file():
            raise ArtifactError(
                f"the package calls {', '.join(library['ops'])}, registered by {library['path']}, which is not "
                "here: install what provides it (or load it with torch.ops.load_library) first"
            )
        torch.ops.load_library(library["path"])


def _registered(op: str) -> bool:
    """Does this process have a kernel for `op` (`torchvision::roi_align`, `ns::op.overload`)?"""
    return torch._C._dispatch_has_kernel(op)


def import_tree_types(runner: Any) -> None:
    """Import the modules defining the types a package's call spec names (a
    transformers ModelOutput, whatever class `from_pretrained` returned):
    pytree must know them to rebuild the output tree, and they register
    themselves when imported."""
    loader = getattr(runner, "loader", None)
    if loader is None:
        return
    for spec in loader.get_call_spec():
        for type_name in re.findall(r'"type":\s*"([A-Za-z_][\w.]*)"', spec):
            module_path = type_name.rpartition(".")[0]
            if module_path and module_path not in sys.modules:
                with contextlib.suppress(Exception):
                    importlib.import_module(module_path)


def load_package(path: Path, device_index: int = -1, model: str = SINGLE_MODEL, single_threaded: bool = False) -> Any:
    """Load one model of a `.pt2` package into this process (torch's AOTICompiledModel).
    `single_threaded`: a runner without its own stream and locks, the only
    kind whose calls can be captured in a CUDA graph."""
    check_temp_dir()  # torch unpacks the package's libraries there: named, not torch's RuntimeError
    if model == SINGLE_MODEL:
        return torch._inductor.aoti_load_package(str(path), single_threaded, device_index)
    # This model only: torch's load_package(path, name) loads every model of the archive to return one.
    from torch._inductor.package.package import AOTICompiledModel

    loader = torch._C._aoti.AOTIModelPackageLoader(str(path), model, single_threaded, 1, device_index)
    return AOTICompiledModel(loader)
