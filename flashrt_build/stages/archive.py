"""The `.pt2` archive's plumbing: the FQNs a model binds, read from its
generated source (the build never runs package code); several methods'
single-model packages combined into one; the record of what a load relies on
sealed inside."""

from __future__ import annotations

import json
import re
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import CompileError
from ..runtime.contract import CONTRACT_MEMBER, read_contract


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
        files: dict[str, list[Any]] = {}  # file paths, as package_aoti takes them
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
