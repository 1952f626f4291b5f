"""The package's layout is its architecture: each folder imports only what
its docstring allows, and the torch-free parts stay torch-free (the command
line decides that a build is up to date without importing torch)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "flashrt_build"

# folder -> the parts of flashrt_build its modules may import
# (`errors` and `artifact`, the output directory's layout, import nothing of flashrt_build: anyone may use them)
ALLOWED = {
    # the runtime is what a serving process installs: nothing of the build system
    "runtime": {"errors", "artifact", "runtime"},
    # the config reads checkpoints and manifests through the runtime's torch-free modules
    "config": {"errors", "artifact", "config", "runtime"},
    "stages": {"errors", "artifact", "config", "runtime", "stages"},
    "cache": {"errors", "artifact", "config", "runtime", "stages", "cache"},
    "sweep": {"errors", "artifact", "config", "runtime", "stages", "cache", "sweep", "pipeline"},
    "commands": {"errors", "artifact", "config", "runtime", "stages", "cache", "commands", "pipeline"},
}
# imported by the command line before it knows whether there is work to do
TORCH_FREE = [
    "config/*.py",
    "cache/[!c]*.py",  # all but compiled.py, which compiles
    "runtime/manifest.py",
    "runtime/hashing.py",
    "runtime/contract.py",
    "runtime/formats.py",
    "runtime/schema.py",
    "runtime/dtypes.py",
    "cli.py",
    "errors.py",
    "artifact.py",
    "stages/publish.py",
]


def imports(path: Path, top_level_only: bool = False) -> list[tuple[str, int]]:
    """The parts of flashrt_build (or other top-level names) `path` imports, with line numbers."""
    tree = ast.parse(path.read_text())
    module = path.relative_to(PACKAGE.parent).with_suffix("").parts
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = []
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(module[: len(module) - node.level])
            parts = [*base, *(node.module.split(".") if node.module else [])]
            found.append((".".join(parts[1:2]) or "__init__", node.lineno))
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.module, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
    return found


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_each_folder_imports_only_what_it_may(folder: str) -> None:
    wrong = []
    for path in sorted((PACKAGE / folder).glob("*.py")):
        for part, line in imports(path):
            own = part.split(".")[0] if not part.startswith("flashrt_build") else part.split(".")[1]
            is_ours = (PACKAGE / own).exists() or (PACKAGE / f"{own}.py").exists()
            if is_ours and own not in ALLOWED[folder] and own != "__init__":
                wrong.append(f"{path.relative_to(PACKAGE)}:{line} imports {own}")
    assert wrong == []


def test_the_torch_free_modules_import_no_torch() -> None:
    heavy = [
        f"{path.relative_to(PACKAGE)}:{line} imports {name}"
        for pattern in TORCH_FREE
        for path in sorted(PACKAGE.glob(pattern))
        for name, line in imports(path, top_level_only=True)
        if name.split(".")[0] in ("torch", "safetensors", "transformers")
    ]
    assert heavy == []


def test_what_an_up_to_date_check_imports_imports_no_torch_at_all() -> None:
    """Transitively, not only the lines each file writes: a subprocess imports
    the command line and everything it uses before there is work to do."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import flashrt_build.cli, flashrt_build.cache.reuse, flashrt_build.config.spec\n"
        "import flashrt_build.runtime.manifest, flashrt_build.runtime.contract, flashrt_build.runtime.formats\n"
        "heavy = sorted(m for m in ('torch', 'safetensors', 'transformers') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
