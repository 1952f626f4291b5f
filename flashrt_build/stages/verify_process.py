"""The fresh process a package is verified in (verify_worker.py), never the
build process: started with the build's inputs, given its time, and when it
dies or hangs, its end said in one line: which call it reached, what killed
it, and what to try."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..config.inputs import MethodSpec
from ..errors import LoaderCrash, VerifyError
from .threads import RUN_THREADS_ENV
from .verify_worker import PROGRESS

log = logging.getLogger("flashrt_build.stages.verify")


@dataclass
class Call:
    """One call of the verification sequence."""

    label: str
    sizes: dict[str, int]
    inputs: dict[str, torch.Tensor]  # by input name
    method: MethodSpec
    edges: dict[str, str] = field(default_factory=dict)  # integer inputs at the ends of their range (make_tensor)


def run_package(
    staging: Path, manifest: dict[str, Any], calls: list[Call], timeout: float, work: Path
) -> dict[str, Any]:
    """Run the sequence on the package in a fresh process; its outputs, or the
    reason it failed: a crash or a hang while loading (the toolchain is the
    usual suspect) told apart from one at a call (the package's own code
    refusing an input, named with the call and its shapes)."""
    (work / "manifest.json").write_text(json.dumps(manifest))
    torch.save([{"label": c.label, "inputs": c.inputs, "method": c.method.name} for c in calls], work / "calls.pt")
    cxx = manifest["toolchain"]["cxx"]["path"]
    try:
        done = _run_worker(staging, work, timeout)
    except subprocess.TimeoutExpired:
        where = _where(work, calls)
        if where is None:
            raise LoaderCrash(
                f"the package hung its loader process past verify.timeout={timeout:g}s while loading, and was "
                f"killed. {_crash_remedy(cxx)}"
            ) from None
        raise LoaderCrash(
            f"the package did not finish {where} within verify.timeout={timeout:g}s, and its process was killed; "
            "raise verify.timeout if the model is that slow here"
        ) from None
    if done.returncode < 0:
        name, where = signal.Signals(-done.returncode).name, _where(work, calls)
        if where is None:
            raise LoaderCrash(f"the package crashed its loader process with {name} while loading. {_crash_remedy(cxx)}")
        said = _what(done.stderr) or _said_on_one_thread(staging, work, timeout)
        raise LoaderCrash(
            f"the package crashed its process with {name} at {where}{f': {said}' if said else ''}. Eager ran "
            "this input; the compiled code refused it (an index out of range, for one)"
        )
    result_path = work / "result.pt"
    if done.returncode != 0 or not result_path.is_file():
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        raise VerifyError(f"loading or running the package in a fresh process failed: {tail}")
    result = torch.load(result_path, weights_only=False)
    if "failed" in result:
        failed = result["failed"]
        (work / PROGRESS).write_text(f"call {failed['call']}")
        said = _package_said(done.stderr) or failed["message"]
        raise VerifyError(
            f"the package raised {failed['error']} at {_where(work, calls)}: {said}. Eager ran this input; "
            "the compiled code refused it"
        )
    return result


def _run_worker(staging: Path, work: Path, timeout: float, threads: int | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "flashrt_build.stages.verify_worker", str(staging), str(work)]
    # The worker imports what this process can: the user's modules included.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path)}
    if threads:
        env[RUN_THREADS_ENV] = str(threads)
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    log.debug("verify worker output:\n%s%s", done.stdout, done.stderr)
    return done


def _said_on_one_thread(staging: Path, work: Path, timeout: float) -> str | None:
    """What the package's own check says when it runs on one thread. Thrown on
    several threads at once, a C++ exception ends the process without its
    message ("terminate called recursively"); on one it reaches Python."""
    (work / "result.pt").unlink(missing_ok=True)
    try:
        again = _run_worker(staging, work, timeout, threads=1)
    except subprocess.TimeoutExpired:
        return None
    said = _what(again.stderr)
    if said is None and (work / "result.pt").is_file():
        failed = torch.load(work / "result.pt", weights_only=False).get("failed")
        said = f"{failed['error']}: {failed['message']}" if failed else None
    return f"{said} (on one thread)" if said else None


def _where(work: Path, calls: list[Call]) -> str | None:
    """Which call the verification process had begun (its label and input
    shapes) when it died or hung; None while it was still loading the package."""
    try:
        step = (work / PROGRESS).read_text()
    except OSError:
        return None
    if not step.startswith("call "):
        return None if step == "loading" else step
    call = calls[int(step.split()[1])]
    shapes = ", ".join(f"{name} {list(t.shape)}" for name, t in call.inputs.items())
    return f"call '{call.label}' ({shapes})"


def _what(stderr: str) -> str | None:
    """The C++ exception's own message (`what():  ...`) from a process that
    aborted. Threads aborting at once interleave their lines (`what():
    terminate called recursively`): such a line is no message, and None sends
    the caller to a run on one thread."""
    for line in stderr.splitlines():
        if "what():" in line and "terminate called" not in line:
            return " ".join(line.split())
    return None


def _package_said(stderr: str) -> str | None:
    """The package's own words for a call it refused. Python is told only
    that the call failed (`run_func_(...) API call failed at ...`); the
    runtime prints the exception: an ATen operator's check as `Exception in
    aoti_torch: ...`, the generated code's own as `Error: ...`."""
    for mark in ("Exception in aoti_torch: ", "Error: "):
        said = [line.split(mark, 1)[1].strip() for line in stderr.splitlines() if mark in line]
        if said:
            return said[-1]
    return None


def _crash_remedy(cxx: str) -> str:
    return (
        f"The usual cause: the C++ compiler that built it ({cxx}) uses a different C++ standard library "
        "than the one torch was built with. Set toolchain.cxx to a compiler that matches torch's "
        "(for example toolchain.cxx=g++-12) and rebuild; `python -m flashrt_build.doctor` checks a toolchain."
    )
