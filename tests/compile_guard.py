"""The test tiers, enforced: a test not marked `slow` compiles no package,
in the test process or in any Python process it starts.

conftest.py names the running test in FORBID_ENV while one that is not
marked `slow` runs (its fixtures' setup included, where session-scoped
builds happen); AOTInductor's compile entry point then raises, naming it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

FORBID_ENV = "FLASHRT_TESTS_NO_COMPILE"


class CompiledInFastTest(AssertionError):
    pass


def _refuse(*args: Any, **kwargs: Any) -> Any:
    raise CompiledInFastTest(
        f"{os.environ[FORBID_ENV]} compiles a package but is not marked slow: add @pytest.mark.slow"
    )


def guard(inductor: ModuleType) -> None:
    """Wrap torch._inductor's AOT compile entry point: refused while FORBID_ENV is set."""
    compile_and_package = inductor.aoti_compile_and_package
    if getattr(compile_and_package, "_guarded", False):
        return

    def guarded(*args: Any, **kwargs: Any) -> Any:
        if os.environ.get(FORBID_ENV):
            return _refuse()
        return compile_and_package(*args, **kwargs)

    guarded._guarded = True  # type: ignore[attr-defined]
    inductor.aoti_compile_and_package = guarded  # type: ignore[attr-defined]


class _GuardOnImport(importlib.abc.MetaPathFinder):
    """Guards torch._inductor when (if ever) the process imports it."""

    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if name != "torch._inductor":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader, exec_module = spec.loader, spec.loader.exec_module

        def exec_and_guard(module: ModuleType) -> None:
            exec_module(module)
            guard(module)

        loader.exec_module = exec_and_guard  # type: ignore[method-assign]
        return spec


def guard_subprocess() -> None:
    if os.environ.get(FORBID_ENV):
        if "torch._inductor" in sys.modules:
            guard(sys.modules["torch._inductor"])
        else:
            sys.meta_path.insert(0, _GuardOnImport())
