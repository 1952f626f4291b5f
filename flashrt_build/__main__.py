"""`python -m flashrt_build` and the `flashrt-build` script: the build
system's command line. Serving needs only torch and safetensors; building
needs the `build` extra (Hydra, OmegaConf), which is checked first so its
absence is one line, not a traceback."""

from __future__ import annotations

import difflib
import importlib
import sys

# `flashrt-build NAME ...` runs the command of that name, as `python -m
# flashrt_build.NAME ...` does: a Hydra override is never a bare word.
COMMANDS = {
    "generate": ("flashrt_build.commands.generate", "text from a causal LM package: generate OUT --prompt TEXT"),
    "check": ("flashrt_build.commands.check", "does a checkpoint fit a package: check OUT CHECKPOINT"),
    "repro": ("flashrt_build.commands.repro", "does a release rebuild byte for byte: repro OUT"),
    "doctor": ("flashrt_build.commands.doctor", "the toolchain, and a canary build: doctor [target=cuda]"),
    "store": ("flashrt_build.commands.clean", "prune the build store: store clean [OUTPUT_ROOT] [--all]"),
    "cpp": ("flashrt_build.commands.cpp", "the C++ library's CMake project: cpp --cmake-dir"),
}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in COMMANDS:
        module = importlib.import_module(COMMANDS[sys.argv[1]][0])
        sys.exit(module.main(sys.argv[2:]))
    if len(sys.argv) > 1 and _a_word(sys.argv[1]):  # no override is a bare word: a command, misspelt
        close = difflib.get_close_matches(sys.argv[1], list(COMMANDS), n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        print(f"flashrt-build: no command {sys.argv[1]!r}; {hint}commands: {', '.join(COMMANDS)}", file=sys.stderr)
        sys.exit(2)
    late = _late_command(sys.argv[2:])
    if late is not None:
        print(f"flashrt-build: {late!r} is a command: it goes first (flashrt-build {late} ...); "
              "what follows it is its own", file=sys.stderr)  # fmt: skip
        sys.exit(2)
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


def _a_word(arg: str) -> bool:
    return arg.isidentifier()


# Hydra's flags that take a value (a config dir named `generate` is one)
_VALUED = {"--config-dir", "-cd", "--config-name", "-cn", "--config-path", "-cp", "--info", "-i"}


def _late_command(args: list[str]) -> str | None:
    """A command's name after the first argument (`-m generate OUT`): an
    override is never a bare word, so it is the command, out of place."""
    for before, arg in zip(["", *args], args, strict=False):
        if arg in COMMANDS and before not in _VALUED:
            return arg
    return None


if __name__ == "__main__":
    main()
