"""What builds a package, described once and without importing torch: the
compiler (which one a config means, its version, the -march it takes), torch,
CUDA, the CPU. The build key hashes part of this description and the
manifest records all of it, so the two cannot disagree."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

from ..errors import ConfigError


@functools.cache
def compiler_version(cxx: str) -> str:
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30, check=False)
        return out.stdout.splitlines()[0].strip() if out.stdout else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def compiler_path(cxx: str | None) -> str:
    """The compiler Inductor will call: toolchain.cxx, else $CXX, else g++."""
    name = cxx or os.environ.get("CXX") or "g++"
    return shutil.which(name) or name


def cpu_isa() -> str:
    """The vector ISA a CPU package is compiled for by default (-march=native)."""
    try:
        found = re.search(r"^flags\s*:(.*)$", Path("/proc/cpuinfo").read_text(), re.M)
    except OSError:
        found = None
    if found is None:
        return platform.machine()
    flags = set(found.group(1).split())
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "AVX512"
    return "AVX2" if "avx2" in flags else platform.machine()


def check_compiler(cxx: str | None) -> None:
    """The compiler a build would call must exist and compile: `toolchain.cxx`,
    else the CXX environment variable, else g++. A ConfigError names
    whichever chose it, before any work (not after a minute of exporting)."""
    if cxx is not None:
        key, value, kind, how = "toolchain.cxx", cxx, "config key", ""
    elif os.environ.get("CXX"):
        key, value, kind = "CXX", os.environ["CXX"], "environment variable"
        how = "; with toolchain.cxx null the build uses $CXX: fix it or set toolchain.cxx"
    else:
        key, value, kind, how = "toolchain.cxx", None, "config key", ""
    name = value or "g++"
    if shutil.which(name) is None:
        what = "no such compiler on PATH" if value else "no C++ compiler: g++ is not on PATH; set toolchain.cxx or CXX"
        raise ConfigError(key, value, what + (how if value else ""), kind)
    failed = compile_rejected(compiler_path(value), None)
    if failed is not None and "No space left on device" in failed:  # the temp dir's fault, not the compiler's
        raise ConfigError(
            "TMPDIR",
            os.environ.get("TMPDIR") or tempfile.gettempdir(),  # Python falls back from a full one; the compiler not
            f"has no space left: a one-line file compiled there fails ({failed}); builds compile in the temp dir, "
            "so free space there or point TMPDIR elsewhere",
            "environment variable",
        )
    if failed is not None:
        raise ConfigError(key, value, f"cannot compile C++ (a one-line file fails: {failed}){how}", kind)


def march_rejected(cxx: str, march: str) -> str | None:
    """None when the compiler accepts `-march=<march>`, else its complaint."""
    return compile_rejected(cxx, march)


@functools.cache
def compile_rejected(cxx: str, march: str | None) -> str | None:
    """None when the compiler turns a one-line C++ file into an object file
    (with `-march=<march>`), else its complaint: a path that names no
    compiler (`/bin/false` fails, `/bin/true` writes nothing)."""
    flags = [f"-march={march}"] if march else []
    try:
        with tempfile.TemporaryDirectory(prefix="flashrt-cxx-") as scratch:
            made = Path(scratch) / "probe.o"
            out = subprocess.run(
                [cxx, *flags, "-x", "c++", "-c", "-", "-o", str(made)],
                input="int flashrt_probe() { return 0; }\n",
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            if out.returncode == 0 and made.is_file() and made.stat().st_size:
                return None
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    lines = [line.strip() for line in out.stderr.splitlines() if "error" in line.lower()]
    fallback = f"exit code {out.returncode}" if out.returncode else "it wrote no object file"
    return (lines or out.stderr.strip().splitlines() or [fallback])[0]


# Every field of the manifest's `toolchain`, written once: describe_toolchain
# records exactly these, and the manifest's schema and docs/building.md are
# checked against them (tests/runtime/test_manifest_schema.py).
TOOLCHAIN_FIELDS = {
    "torch": "torch's version, its local part included (2.14.1+cu130)",
    "python": "the interpreter's version",
    "hydra_core": "hydra-core's version",
    "omegaconf": "omegaconf's version",
    "safetensors": "safetensors' version",
    "torchao": "torchao's version (a quantized build's key includes it)",
    "cxx": "the C++ compiler Inductor calls: its path and version",
    "cuda": "the CUDA version torch was built with (null: a CPU build of torch)",
    "gpu": "the target GPU: name, compute capability, index, uuid, memory_gb, visible_devices (null: a CPU target)",
    "cpu_isa": "the vector ISA a CPU package is compiled for by default (-march=native)",
    "platform": "the operating system and machine",
    "executable": "the Python that ran the build",
    "lock": "the requirements lock this checkout installs from: path and sha256 (null: an installed wheel)",
}
# The fields an artifact's bytes depend on (the build key's).
KEY_FIELDS = ("torch", "python", "cxx", "cuda", "cpu_isa", "gpu")


def describe_toolchain(cxx: str | None, gpu: dict[str, Any] | None) -> dict[str, Any]:
    """The toolchain section of the manifest. `cxx`: the config's compiler
    (`toolchain.cxx`, null for $CXX or g++); `gpu`: the target GPU's identity
    (`runtime.gpu.gpu_of`), None for a CPU target."""
    path = compiler_path(cxx)
    return {
        "torch": torch_version_file("version") or _version("torch"),
        "python": platform.python_version(),
        "hydra_core": _version("hydra-core"),
        "omegaconf": _version("omegaconf"),
        "safetensors": _version("safetensors"),
        "torchao": _version("torchao"),  # quantizes the weights of a build with a `quant` recipe
        "cxx": {"path": path, "version": compiler_version(path)},
        "cuda": torch_cuda_version(),
        "gpu": gpu,
        "cpu_isa": cpu_isa(),
        "platform": platform.platform(),
        "executable": sys.executable,
        "lock": _lock_file(),
    }


def torch_cuda_version() -> str | None:
    """torch.version.cuda, without importing torch."""
    return torch_version_file("cuda")


def torch_version_file(field: str) -> str | None:
    """A field of torch's version.py (`__version__` with its local part,
    "2.14.1+cu130"; `cuda`), read without importing torch."""
    found = importlib.util.find_spec("torch")
    if found is None or not found.submodule_search_locations:
        return None
    text = (Path(found.submodule_search_locations[0]) / "version.py").read_text()
    name = "__version__" if field == "version" else field
    match = re.search(rf"^{name}\s*(?::[^=]*)?=\s*['\"]([^'\"]*)['\"]", text, re.M)
    return match.group(1) if match else None


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _lock_file() -> dict[str, str] | None:
    """The pinned lock this checkout installs from (requirements.lock), if any."""
    path = Path(__file__).resolve().parents[2] / "requirements.lock"
    if not path.is_file():
        return None
    return {"path": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
