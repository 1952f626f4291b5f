"""flashrt_build: a declarative build system for PyTorch AOTInductor packages.

    result = flashrt_build.build(cfg)        # config -> model.pt2 + manifest.json
    model = flashrt_build.load(result.output_dir)

Imports are lazy: the command line decides that a build is up to date without
importing torch.
"""

import importlib as _importlib

__version__ = "0.1.0"

_EXPORTS = {
    "BuildResult": "pipeline",
    "build": "pipeline",
    "check_checkpoint": "runtime.checkpoint",
    "compose": "config.compose",
    "is_exporting": "stages.exporting",
    "LoadedModule": "runtime.load",
    "load": "runtime.load",
    "Generation": "runtime.generate",
    "generate": "runtime.generate",
    "ArtifactError": "errors",
    "BuildError": "errors",
    "CompileError": "errors",
    "ConfigError": "errors",
    "ExportError": "errors",
    "FlashrtError": "errors",
    "InstantiateError": "errors",
    "UnexpectedError": "errors",
    "LoaderCrash": "errors",
    "VerifyError": "errors",
    "WeightsMismatch": "errors",
}

__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str) -> object:
    if name in _EXPORTS:
        value = getattr(_importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names (imported lazily), as `dir(flashrt_build)` shows them."""
    return sorted({*__all__, "__version__"})
