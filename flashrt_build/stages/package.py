"""Stage 5: compile the exported graph with AOTInductor into a `.pt2` package."""

from __future__ import annotations

import contextlib
import difflib
import errno
import fcntl
import io
import json
import re
import shutil
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..config.schema import WeightsMode
from ..errors import BuildError, CompileError, ConfigError, first_lines, raise_all
from ..runtime.manifest import CONTRACT_MEMBER, read_contract

# Options flashrt_build sets itself, whatever the profile says.
FORCED_OPTIONS: dict[str, Any] = {
    # Tiny constants would otherwise be inlined into the code and vanish from
    # get_constant_fqns(), so the manifest could not list every weight.
    "always_keep_tensor_constants": True,
}


def mode_options(weights: WeightsMode) -> dict[str, Any]:
    """Options the weights mode sets: external packages carry no constants."""
    return {"aot_inductor.package_constants_in_so": weights is WeightsMode.baked}


def validate_inductor_options(options: Mapping[str, Any], weights: WeightsMode = WeightsMode.baked) -> dict[str, Any]:
    """Check option names and value types against torch's Inductor config and
    add the options flashrt_build sets itself."""
    forced = {**FORCED_OPTIONS, **mode_options(weights)}
    known = torch._inductor.config.get_config_copy()
    problems = []
    for key, value in options.items():
        if key not in known:
            close = difflib.get_close_matches(key, list(known), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            problems.append(
                ConfigError(
                    f"inductor.options.{key}", value, f"not an Inductor option in torch {torch.__version__}{hint}"
                )
            )
            continue
        default = known[key]
        if isinstance(default, bool) and not isinstance(value, bool):
            problems.append(ConfigError(f"inductor.options.{key}", value, "expected true or false"))
        elif key in forced and value != forced[key]:
            problems.append(ConfigError(f"inductor.options.{key}", value, f"flashrt_build sets {forced[key]!r} here"))
    raise_all(problems)
    return {**options, **forced}


def compile_package(
    program: torch.export.ExportedProgram,
    options: Mapping[str, Any],
    package_path: Path,
    target: str,
    cache_dir: Path | None = None,
) -> Path:
    """AOTInductor compile + package, with `options` already validated.

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
        return _compile(program, options, package_path, target)


def _compile(
    program: torch.export.ExportedProgram, options: Mapping[str, Any], package_path: Path, target: str
) -> Path:
    package = _GuardedFile(package_path)
    try:
        torch._inductor.aoti_compile_and_package(program, package_path=package, inductor_configs=dict(options))
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


def seal_package(package_path: Path, contract: Mapping[str, Any], already: bool = False) -> None:
    """Record what a load relies on inside the package (`CONTRACT_MEMBER`),
    whose digest the manifest records, so an edited manifest is refused. A
    package reused from the store (`already`) carries it: it must agree."""
    if already:
        if read_contract(package_path) != contract:
            raise CompileError(f"the stored package {package_path} was built for another contract; clean the store")
        return
    with zipfile.ZipFile(package_path, "a") as archive:
        folder = archive.namelist()[0].partition("/")[0]
        # fixed metadata and order: a release build stays byte-for-byte reproducible
        member = zipfile.ZipInfo(f"{folder}/{CONTRACT_MEMBER}", date_time=(1980, 1, 1, 0, 0, 0))
        archive.writestr(member, json.dumps(contract, sort_keys=True, separators=(",", ":")))


# Where a model's compiled files live inside a .pt2 archive.
_MODEL_DIR = re.compile(r"^[^/]+/data/aotinductor/([^/]+)/([^/]+)$")
# What an AOTInductor package holds besides its models' files.
_ARCHIVE_RECORDS = {
    "archive_format",
    "archive_version",
    ".data/version",
    "byteorder",
    ".data/serialization_id",
    CONTRACT_MEMBER,
}


def package_constant_fqns(path: Path, model: str | None = None) -> list[str]:
    """The FQNs a package's model binds, read from its generated wrapper
    source, so the build process never runs package code. The verifier
    cross-checks them against `get_constant_fqns()` in a fresh process."""
    with zipfile.ZipFile(path) as archive:
        wrappers = [
            n
            for n in archive.namelist()
            if n.endswith(".wrapper.cpp") and (model is None or f"/data/aotinductor/{model}/" in n)
        ]
        if len(wrappers) != 1:
            raise CompileError(f"{path} holds {len(wrappers)} wrapper sources for model {model}; expected one")
        source = archive.read(wrappers[0]).decode()
    return re.findall(r'constants_info_\[\d+\]\.original_fqn = "([^"]*)";', source)


def combine_packages(parts: Mapping[str, Path], package_path: Path) -> Path:
    """One .pt2 holding each single-model package of `parts` as the model of
    that name, the layout AOTInductor loads a model from by name. Each part
    was compiled (and is cached) on its own, so changing one method's inputs
    recompiles that method only."""
    from torch._inductor.package import package_aoti

    with tempfile.TemporaryDirectory(prefix="flashrt-combine-") as scratch:
        files: dict[str, list[str]] = {}
        for name, part in parts.items():
            folder = Path(scratch) / name
            folder.mkdir()
            with zipfile.ZipFile(part) as archive:
                for member in sorted(archive.namelist()):
                    found = _MODEL_DIR.match(member)
                    if found is None:
                        if member.partition("/")[2] not in _ARCHIVE_RECORDS:
                            raise CompileError(f"{part} holds {member}, which flashrt_build cannot combine")
                        continue
                    (folder / found.group(2)).write_bytes(archive.read(member))
                    files.setdefault(name, []).append(str(folder / found.group(2)))
        package_aoti(str(package_path), files)
    return package_path
