"""flashrt_build: a declarative build system for PyTorch AOTInductor packages.

    result = flashrt_build.build(cfg)        # config -> model.pt2 + manifest.json
    model = flashrt_build.load(result.output_dir)

Imports are lazy: the command line decides that a build is up to date without
importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "BuildResult": "pipeline",
    "build": "pipeline",
    "check_checkpoint": "checkpoint",
    "compose": "config",
    "is_exporting": "export",
    "LoadedModule": "load",
    "load": "load",
    "ArtifactError": "errors",
    "BuildError": "errors",
    "CompileError": "errors",
    "ConfigError": "errors",
    "ExportError": "errors",
    "FlashrtError": "errors",
    "InstantiateError": "errors",
    "LoaderCrash": "errors",
    "VerifyError": "errors",
    "WeightsMismatch": "errors",
}

__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        module = importlib.import_module(f".{_EXPORTS[name]}", __name__)
        # Every export of that module at once: importing `.load` set the
        # package's `load` to the module, which the function must replace.
        globals().update({n: getattr(module, n) for n, m in _EXPORTS.items() if m == _EXPORTS[name]})
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
