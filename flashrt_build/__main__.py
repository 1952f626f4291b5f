"""`python -m flashrt_build` and the `flashrt-build` script: the build
system's command line. Serving needs only torch and safetensors; building
needs the `build` extra (Hydra, OmegaConf), which is checked first so its
absence is one line, not a traceback."""

from __future__ import annotations

import sys


def main() -> None:
    if "--version" in sys.argv[1:] or "-V" in sys.argv[1:]:  # ours, not Hydra's own version
        from . import __version__

        print(f"flashrt_build {__version__}")
        return
    try:
        import hydra  # noqa: F401
        import omegaconf  # noqa: F401
    except ImportError as exc:
        print(
            f"flashrt_build: building needs the build system's dependencies ({exc}): "
            "pip install 'flashrt_build[build]' (serving a built package needs only torch and safetensors)",
            file=sys.stderr,
        )
        sys.exit(2)
    from .cli import main as build_command

    build_command()


if __name__ == "__main__":
    main()
