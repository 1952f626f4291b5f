"""The package's layout is its architecture: each folder imports only what
its docstring allows, and the torch-free parts stay torch-free (the command
line decides that a build is up to date without importing torch)."""

from __future__ import annotations

import ast
import re
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
    # the cache and the stages know nothing of each other: the build hands the store to the compile stage
    "cache": {"errors", "artifact", "config", "runtime", "cache"},
    "sweep": {"errors", "artifact", "config", "runtime", "stages", "cache", "sweep", "pipeline"},
    "commands": {"errors", "artifact", "config", "runtime", "stages", "cache", "commands", "pipeline"},
}
# imported by the command line before it knows whether there is work to do
TORCH_FREE = [
    "config/*.py",
    "cache/*.py",
    "runtime/manifest.py",
    "runtime/hashing.py",
    "runtime/contract.py",
    "runtime/formats.py",
    "runtime/schema.py",
    "runtime/dtypes.py",
    "runtime/tempdir.py",
    "cli.py",
    "errors.py",
    "artifact.py",
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


REPO = PACKAGE.parent
# Sources a reader should take in one sitting: no module (Python or C++) over
# 300 lines, no Python function over 60.
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 300, 60
SOURCES = [*PACKAGE.rglob("*.py"), *(REPO / "cpp").rglob("*.cpp"), *(REPO / "cpp").rglob("*.h")]


def test_no_module_is_over_300_lines() -> None:
    long = {str(p.relative_to(REPO)): n for p in SOURCES if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def test_no_function_is_over_60_lines() -> None:
    long = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(REPO)}:{node.name}"] = lines
    assert long == {}


@pytest.mark.parametrize("folder", sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py")))
def test_each_folders_docstring_lists_exactly_its_modules(folder: str) -> None:
    """The map a reader starts from is the territory: every module named, none that is gone."""
    docstring = ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text())) or ""
    listed = set(re.findall(r"^\s+([a-z0-9_]+\.py)\b", docstring, flags=re.M))
    present = {p.name for p in (PACKAGE / folder).glob("*.py") if p.name != "__init__.py"}
    assert listed == present


def test_stages_are_not_numbered_in_docstrings() -> None:
    """Their order is the pipeline's own (pipeline.py); numbers in prose drift from it."""
    numbered = [
        str(p.relative_to(REPO))
        for p in PACKAGE.rglob("*.py")
        if re.search(r"\bStage \d|^\s+\S+\.py\s+\d\.", p.read_text(), re.M)
    ]
    assert numbered == []


DEVELOPMENT = REPO / "docs" / "development.md"
FOLDERS = ["config", "cache", "stages", "runtime", "sweep", "commands"]  # in the map's order


def folder_map(folder: str) -> str:
    """The development map's lines for a folder, from its docstring: its
    first line, then the modules it lists, as it words them."""
    docstring = ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text())) or ""
    first = docstring.split("\n\n", 1)[0].replace("\n", " ")
    modules = [line.strip() for line in docstring.splitlines() if re.match(r"\s+[a-z0-9_.]+\.(py|json)\b", line)]
    return "\n".join([f"  {folder + '/':<21}{first}", *(f"    {line}" for line in modules)])


def test_the_development_map_is_the_folder_docstrings() -> None:
    """docs/development.md's map of the package is each folder's docstring
    (checked here, so it cannot drift); the top-level modules are named in it.
    `python tests/test_layout.py` prints the folders' part to paste."""
    text = DEVELOPMENT.read_text()
    block = text.split("```\nflashrt_build/\n", 1)[1].split("```", 1)[0]
    for folder in FOLDERS:
        assert folder_map(folder) in block, f"docs/development.md's map of {folder}/ is not its docstring's"
    top_level = {p.name for p in PACKAGE.glob("*.py")}
    named = set(re.findall(r"\b\w+\.py\b", block))
    assert top_level <= named, f"top-level modules missing from docs/development.md's map: {top_level - named}"


if __name__ == "__main__":
    print("\n".join(folder_map(folder) for folder in FOLDERS))
