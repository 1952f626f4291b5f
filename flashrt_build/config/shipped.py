"""Where what ships with the tool lives: the configs (`conf/`) and the C++
library's sources (`cpp/`). A checkout keeps them at the repository's top,
the layout users were promised; a wheel carries them inside the package
(`flashrt_build/conf`, `flashrt_build/cpp_source`, pyproject.toml maps them),
so an installed tool works from any directory."""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]


def _shipped(installed: str, checkout: str) -> Path:
    inside = PACKAGE_DIR / installed
    return inside if inside.is_dir() else PACKAGE_DIR.parent / checkout


CONF_DIR = _shipped("conf", "conf")
CPP_DIR = _shipped("cpp_source", "cpp")
