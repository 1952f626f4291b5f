"""The compile: AOTInductor turns each method's exported graph into a `.pt2`
package (several methods: a model each, combined into one), unless a model
compiled before is kept by its key (a checkpoint swap of an external-weights
package, one method changed among several). Inductor's options validated, a
fresh cache for a reproducible release, a full disk or a compiler failure
said in one line."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from ..artifact import PACKAGE
from ..config.schema import WeightsMode
from ..config.spec import BuildSpec
from ..errors import BuildError, CompileError, first_lines
from .archive import combine_packages
from .export import Exported
from .pdl import patched_launcher
from .pdl import unavailable as pdl_unavailable
from .progress import StageTimer

log = logging.getLogger("flashrt_build")

# Options flashrt_build sets itself, whatever the profile says.
FORCED_OPTIONS: dict[str, Any] = {
    # Tiny constants would otherwise be inlined into the code and vanish from
    # get_constant_fqns(), so the manifest could not list every weight.
    "always_keep_tensor_constants": True,
}


def mode_options(weights: WeightsMode) -> dict[str, Any]:
    """Options the weights mode sets: external packages carry no constants."""
    return {"aot_inductor.package_constants_in_so": weights is WeightsMode.baked}


def method_options(exported: Exported, spec: BuildSpec) -> dict[str, Any]:
    """Options one method's compile sets beyond the profile's (the manifest's
    `methods.*.inductor_options`): the passes' and its own from
    `inductor.methods` (`BuildSpec.method_inductor_options_of`), and what its
    program needs. A program that writes its state in place
    reads it as a constant, and Inductor folds constants of one value into
    literals: a step counter's `steps + 1` became `1.0` on every call. Such
    programs compile without that folding."""
    options = spec.method_inductor_options_of(exported.method.name)
    if exported.state and not exported.threaded:
        options["joint_graph_constant_folding"] = False
    return options


class KeptModels(Protocol):
    """Compiled models kept by key, as the compile stage asks for them; the
    build hands in the cache's store (`cache.reuse.StoredModels`)."""

    @property
    def keys(self) -> Mapping[str, tuple[str, str]]:
        """Per method, (key, where its compiled model is kept)."""
        ...

    def find(self, key: str, where: str) -> Path | None: ...

    def keep(self, key: str, part: Path) -> None: ...


def compile_stage(
    spec: BuildSpec,
    exported: list[Exported],
    options: Mapping[str, Any],
    package_path: Path,
    kept: KeptModels,
    cache_dir: Path | None,
    timer: StageTimer,
) -> dict[str, bool]:
    """Compile each method into `package_path`, or link its kept model;
    per method, whether it was reused. A stage of its own per method (its
    log line, its timing)."""
    reused: dict[str, bool] = {}
    pdl = spec.pdl and pdl_unavailable(spec) is None  # the launcher of every method's model
    scratch = package_path.parent / ".methods"  # inside staging: a killed build leaves nothing behind
    try:
        parts = {}
        for e in exported:
            name, (key, where) = e.method.name, kept.keys.get(e.method.name, ("", ""))
            parts[name] = part = scratch / name / PACKAGE if spec.multi_method else package_path
            part.parent.mkdir(parents=True, exist_ok=True)
            previous = kept.find(key, where) if key else None
            reused[name] = previous is not None
            if previous is not None:
                _link_or_copy(previous, part)
                what = "reusing the model of method key" if spec.multi_method else "reusing the package of graph"
                log.info("%-11s %8s  %s%s %s", "compile", "skipped", f"{name}: " * spec.multi_method, what, key[:12])
                continue
            target = f"{spec.target} method {name}" if spec.multi_method else spec.target
            with timer.stage(f"compile {name}" if spec.multi_method else "compile"):
                own = {**options, **method_options(e, spec)}
                compile_package(e.program, own, part, target, cache_dir, pdl=pdl)
            if spec.multi_method:
                kept.keep(key, part)
        if spec.multi_method:
            combine_packages(parts, package_path)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return reused


def _link_or_copy(source: Path, dest: Path) -> None:
    """A hard link (the kept model stays when this name goes); a copy across filesystems."""
    try:
        os.link(source, dest)
    except OSError:
        shutil.copyfile(source, dest)


def compile_package(
    program: torch.export.ExportedProgram,
    options: Mapping[str, Any],
    package_path: Path,
    target: str,
    cache_dir: Path | None = None,
    pdl: bool = False,
) -> Path:
    """AOTInductor compile + package, with `options` already validated.
    `pdl`: the launcher launches the package's flashrt_pdl_* kernels as
    programmatic dependents (pdl.py).

    `cache_dir`: compile in this Inductor cache directory, emptied first. The
    cache path ends up in comments, kernel file names and the .so, and a warm
    cache appends compile commands to the sources, so a release build uses a
    fresh one at a fixed path.
    """
    with contextlib.ExitStack() as stack:
        if cache_dir is not None:
            from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

            cache_dir.parent.mkdir(parents=True, exist_ok=True)
            lock = stack.enter_context(open(f"{cache_dir}.lock", "a"))  # one compile per cache dir at a time
            fcntl.flock(lock, fcntl.LOCK_EX)
            shutil.rmtree(cache_dir, ignore_errors=True)
            cache_dir.mkdir()
            stack.enter_context(temporary_cache_dir(str(cache_dir)))
        if pdl:
            stack.enter_context(patched_launcher())
        return _compile(program, options, package_path, target)


def _compile(
    program: torch.export.ExportedProgram, options: Mapping[str, Any], package_path: Path, target: str
) -> Path:
    package = _GuardedFile(package_path)
    try:
        torch._inductor.aoti_compile_and_package(
            program,
            package_path=package,  # type: ignore[arg-type]  # a binary IO
            inductor_configs=dict(options),
        )
    except Exception as exc:
        if package.error is None:
            no_space = no_space_left(exc)
            if no_space:
                raise BuildError(f"no space left on the temp dir, where Inductor compiles: {no_space}") from exc
            raise CompileError(
                f"AOTInductor failed to compile {target} ({type(exc).__name__}): {first_lines(exc, 4)}"
            ) from exc
    finally:
        package.close()
    if package.error is not None:
        raise BuildError(f"writing the package to {package_path} failed: {package.error}") from package.error
    return package_path


def no_space_left(exc: BaseException) -> str | None:
    """The message of a "no space left on device" anywhere in an exception's chain, else None."""
    seen: BaseException | None = exc
    while seen is not None:
        if (isinstance(seen, OSError) and seen.errno == errno.ENOSPC) or "No space left on device" in str(seen):
            return first_lines(seen, 1)
        seen = seen.__cause__ or seen.__context__
    return None


class _GuardedFile(io.RawIOBase):
    """The package file as torch's archive writer sees it. torch writes the
    archive in C++ and finishes it in a destructor; when a write fails there
    (a full disk), the destructor throws and the process aborts. Here a failed
    write is recorded and the rest skipped, so the build reports it instead."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self._file = open(path, "wb")  # noqa: SIM115 - closed by close()
        self.error: OSError | None = None

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        if self.error is None:
            try:
                self._file.write(data)
            except OSError as exc:
                self.error = exc
        return size

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if self.error is None:
            try:
                return self._file.seek(offset, whence)
            except OSError as exc:
                self.error = exc
        return 0

    def tell(self) -> int:
        return self._file.tell() if self.error is None else 0

    def close(self) -> None:
        if not self._file.closed:
            try:
                self._file.close()
            except OSError as exc:
                self.error = self.error or exc
        super().close()
