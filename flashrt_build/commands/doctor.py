"""Check the toolchain for a target in seconds, before a long build finds out.

    python -m flashrt_build.doctor [target=cuda] [toolchain.cxx=g++-12] [key=value ...]

Checks Python and torch, the C++ compiler Inductor will call, the Python
headers, for CUDA targets the GPU and the CUDA toolkit headers; then builds a
canary package (the mlp example) for the target and loads and runs it in a
fresh process, like every build's verification. When loading crashes, it
tries the other compilers on PATH and names one that works.

Exit codes: 0 every check passed; 1 a check failed; 2 the arguments are wrong.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from ..config.compose import compose
from ..config.spec import BuildSpec, resolve_spec
from ..config.toolchain import compiler_path, compiler_version
from ..errors import ConfigError, FlashrtError, LoaderCrash, quiet_known_warnings

# Compilers worth trying when the configured one builds packages that crash.
ALTERNATIVE_COMPILERS = ("g++-12", "g++-11", "g++-13", "g++-14", "g++", "clang++")


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str | None = None

    def line(self) -> str:
        text = f"  {'ok  ' if self.ok else 'FAIL'}  {self.name}: {self.detail}"
        return text + (f"\n        fix: {self.fix}" if self.fix else "")


def check_python() -> Check:
    import torch

    built_with = re.search(r"GCC (\d+[.\d]*)", torch.__config__.show())
    detail = f"Python {sys.version.split()[0]}, torch {torch.__version__}"
    return Check("python", True, detail + (f" (built with GCC {built_with.group(1)})" if built_with else ""))


def check_compiler(spec: BuildSpec) -> Check:
    cxx = compiler_path(spec.inductor_options.get("cpp.cxx"))
    if shutil.which(cxx) is None:
        return Check("C++ compiler", False, f"{cxx} not found", "install one, or set toolchain.cxx=PATH (or $CXX)")
    return Check("C++ compiler", True, f"{cxx} ({compiler_version(cxx)})")


def check_python_headers() -> Check:
    header = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not header.is_file():
        return Check("Python headers", False, f"{header} is missing", "install python3-dev (or your Python's headers)")
    return Check("Python headers", True, str(header))


def check_cuda(spec: BuildSpec) -> list[Check]:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    from ..runtime.gpu import gpu_of
    from ..stages.preflight import check_device

    try:
        check_device(spec.device)  # what a build would refuse
    except ConfigError as exc:
        return [Check("CUDA device", False, exc.expected, "run on a GPU machine, or use target=cpu")]
    gpu = gpu_of(spec.device)
    assert gpu is not None
    checks = [Check("CUDA device", True, f"{spec.device}: {gpu['name']}, compute capability {gpu['capability']}")]
    header = Path(CUDA_HOME or "/usr/local/cuda") / "include" / "cuda_runtime_api.h"
    if not header.is_file():
        fix = "install the CUDA toolkit (its headers) and set CUDA_HOME"
        checks.append(Check("CUDA toolkit", False, f"no {header}", fix))
    else:
        nvcc = Path(CUDA_HOME or "") / "bin" / "nvcc"
        version = ""
        if nvcc.is_file():
            out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True).stdout
            found = re.search(r"release ([\d.]+)", out)
            version = f", nvcc {found.group(1)}" if found else ""
        checks.append(Check("CUDA toolkit", True, f"{CUDA_HOME}{version}; torch built for CUDA {torch.version.cuda}"))
    return checks


def canary(overrides: Sequence[str], cxx: str | None = None) -> tuple[bool, str, FlashrtError | None]:
    """Build, load and run the mlp example for the target in a scratch directory."""
    from ..pipeline import build

    extra = [f"toolchain.cxx={cxx}"] if cxx else []
    with tempfile.TemporaryDirectory(prefix="flashrt-doctor-") as root:
        cfg = compose(["+module=mlp", *overrides, *extra, f"output_root={root}", "verify.repeat=1", "force=true"])
        start = time.perf_counter()
        try:
            result = build(cfg)
        except FlashrtError as exc:
            return False, f"{type(exc).__name__}: {exc}", exc
    seconds = time.perf_counter() - start
    compile_s = result.manifest["timings"].get("compile", 0.0)
    return True, f"built (compile {compile_s:.1f}s), loaded and verified in a fresh process in {seconds:.1f}s", None


def find_working_compiler(overrides: Sequence[str], failing: str) -> str | None:
    """The first other compiler on PATH whose canary package loads and runs."""
    seen = {Path(shutil.which(failing) or failing).resolve()}
    for name in ALTERNATIVE_COMPILERS:
        path = shutil.which(name)
        if path is None or Path(path).resolve() in seen:
            continue
        seen.add(Path(path).resolve())
        print(f"  ...   trying {name} ({compiler_version(path)})", flush=True)
        if canary(overrides, cxx=name)[0]:
            return name
    return None


def run(overrides: Sequence[str]) -> list[Check]:
    spec = resolve_spec(compose(["+module=mlp", *overrides]))
    print(f"flashrt_build doctor: target {spec.target_name} ({spec.device}, {spec.dtype})", flush=True)
    checks: list[Check] = []

    def report(check: Check) -> None:
        checks.append(check)
        print(check.line(), flush=True)

    report(check_python())
    compiler = check_compiler(spec)
    report(compiler)
    report(check_python_headers())
    if spec.device.startswith("cuda"):
        for check in check_cuda(spec):
            report(check)
    if not all(c.ok for c in checks):
        report(Check("canary package", False, "skipped: fix the checks above first"))
        return checks
    ok, detail, error = canary(overrides)
    fix = None
    if isinstance(error, LoaderCrash):
        failing = compiler_path(spec.inductor_options.get("cpp.cxx"))
        working = find_working_compiler(overrides, failing)
        detail = f"packages built with {failing} ({compiler_version(failing)}) crash when loaded: {error}"
        if working:
            fix = f"build with toolchain.cxx={working} (or export CXX={working}); its canary loads and runs"
        else:
            fix = "no compiler on PATH builds loadable packages; install the one torch was built with (see above)"
    report(Check("canary package", ok, detail, fix))
    return checks


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="        %(message)s")  # the build's own lines stay quiet
    quiet_known_warnings()
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        return 0
    flag = next((a for a in args if a.startswith("-")), None)
    if flag is not None:  # Hydra's grammar would ask to quote it
        print(f"flashrt_build doctor: {flag!r} is not an option of doctor, which takes overrides only "
              "(target=cuda, inductor=...): see --help", file=sys.stderr)  # fmt: skip
        return 2
    try:
        checks = run(args)
    except (ConfigError, HydraException, OmegaConfBaseException) as exc:
        print(f"flashrt_build doctor: {exc}", file=sys.stderr)
        return 2
    failed = [c.name for c in checks if not c.ok]
    print(f"{'all checks passed' if not failed else 'failed: ' + ', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
