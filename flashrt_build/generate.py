"""`python -m flashrt_build.generate OUTPUT_DIR --prompt TEXT`: text in, text
out (flashrt_build/commands/generate.py).

Imported rather than run, this module stands aside for the function of its
name: `flashrt_build.generate` is `runtime.generate.generate`, and importing a
submodule `flashrt_build.generate` would otherwise replace it on the package."""

import sys

if __name__ == "__main__":
    from flashrt_build.commands.generate import main

    sys.exit(main())
else:
    from .runtime.generate import generate

    sys.modules[__name__] = generate  # type: ignore[assignment]  # what the import binds on the package
