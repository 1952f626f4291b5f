"""flashrt_build: a declarative build system for PyTorch AOTInductor packages.

result = flashrt_build.build(cfg)        # config -> model.pt2 + manifest.json
model = flashrt_build.load(result.output_dir)
"""

__version__ = "0.1.0"

from .checkpoint import check_checkpoint  # noqa: E402
from .config import compose  # noqa: E402
from .errors import (  # noqa: E402
    ArtifactError,
    BuildError,
    CompileError,
    ConfigError,
    ExportError,
    FlashrtError,
    InstantiateError,
    VerifyError,
    WeightsMismatch,
)
from .export import is_exporting  # noqa: E402
from .load import LoadedModule, load  # noqa: E402
from .pipeline import BuildResult, build  # noqa: E402

__all__ = [
    "ArtifactError",
    "BuildError",
    "BuildResult",
    "CompileError",
    "ConfigError",
    "ExportError",
    "FlashrtError",
    "InstantiateError",
    "LoadedModule",
    "VerifyError",
    "WeightsMismatch",
    "__version__",
    "build",
    "check_checkpoint",
    "compose",
    "is_exporting",
    "load",
]
