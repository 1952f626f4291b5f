"""One job of a sweep (a Hydra multirun): its build runs in a fresh process,
and it leaves a record in its job directory for the sweep summary.

A fresh process per build because launchers reuse theirs (the basic launcher
runs every job in one process, joblib's workers take job after job) and a
build changes process state: imported user modules, torch's and Inductor's
globals, thread counts. So nothing leaks from one job into the next, and a
crash (a segfaulting compiler, the OOM killer) fails one job, not the sweep.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from ..artifact import MANIFEST
from ..config.compose import Naming
from ..errors import FlashrtError, report_failure
from ..runtime.manifest import read_manifest
from ..stages.threads import available_cpus, job_threads, threads_env
from .gpus import gpu_slot

log = logging.getLogger("flashrt_build")

RECORD = "flashrt_job.json"  # what the summary reads, one per job directory
BUILD_CONFIG = "build_config.yaml"  # the job's resolved config, for its build process
BUILD_RESULT = "build_result.json"  # what the build process reports back


def run_sweep_job(cfg: DictConfig, naming: Naming | None = None) -> int:
    """Build one job of a multirun and record the outcome; returns its exit code.
    `naming` names its output folder (cli.run_job's)."""
    from ..cache.plan import make_plan
    from ..cache.reuse import decide

    hydra = HydraConfig.get()
    job_dir = Path(hydra.runtime.output_dir)
    threads = cfg.get("threads") or job_threads(hydra.launcher, available_cpus())
    record: dict[str, Any] = {
        "job": hydra.job.num,
        "overrides": list(hydra.overrides.task),
        "status": "running",  # stays so if this process dies: the summary reports it
        "job_dir": str(job_dir.resolve()),
        "log": str((job_dir / f"{hydra.job.name}.log").resolve()),
        "overrides_file": str((job_dir / hydra.output_subdir / "overrides.yaml").resolve())
        if hydra.output_subdir
        else None,
        "threads": threads,
        "slurm_job_id": slurm_job_id(),  # what sacct, squeue and scancel call this job
    }
    _write_record(job_dir, record)
    in_slurm_job = record["slurm_job_id"] is not None and "SlurmLauncher" in str(hydra.launcher.get("_target_"))
    if in_slurm_job:
        # SLURM warns a job before its time limit (submitit's `--signal=USR2@...`) so that it can requeue
        # itself; a build cannot resume, so it runs until SLURM stops it (SIGTERM) and says why.
        with contextlib.suppress(ValueError):  # not the main thread: nothing to change
            signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # the build process inherits it
    start = time.perf_counter()
    record["started_at"] = time.time()  # wall clock: a sweep's timeline across processes and GPUs
    try:
        plan = make_plan(cfg, naming=naming)  # torch-free: an up-to-date job costs a fraction of a second
        spec = plan.spec
        record.update(name=spec.name, output_dir=str(spec.output_dir))
        decided = decide(plan, say_why=False)
        if decided.built:
            outcome: dict[str, Any] = {"status": decided.status}
        else:
            plan.remembered.save(create=True)  # the build process reads what was hashed here, not the files
            with gpu_slot(spec.device) as gpu_env:  # one build per GPU at a time
                record["gpu"] = (gpu_env or {}).get("FLASHRT_GPU")
                record["build_started_at"] = time.time()
                tag = f"[job {hydra.job.num}{'' if record['gpu'] is None else ' gpu ' + record['gpu']}]"
                outcome = _build_in_fresh_process(cfg, job_dir, threads, tag, gpu_env or {})
                record["build_finished_at"] = time.time()
    except FlashrtError as exc:
        outcome = failure(report_failure(log, exc))
    error = outcome.get("error") or {}
    if in_slurm_job and error.get("type") == "Interrupted":
        error["message"] = slurm_stopped(record["slurm_job_id"]) + error["message"]
    record["finished_at"] = time.time()
    record["wall_s"] = round(time.perf_counter() - start, 3)
    record.update(_row_fields(outcome, record.get("output_dir")))
    _write_record(job_dir, record)
    if in_slurm_job and record["exit_code"]:
        # submitit ends a job's process with 0 once it has saved the job's return value; a failed
        # build's job exits with its code after that, so that sacct says FAILED.
        atexit.register(_exit_now, int(record["exit_code"]))
    return int(record["exit_code"])


def _exit_now(code: int) -> None:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def slurm_job_id() -> str | None:
    """This process's SLURM job as sacct names it (`123_4` for a task of an
    array, as submitit submits a sweep), or None outside SLURM."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{task}" if array and task else os.environ.get("SLURM_JOB_ID")


# Why SLURM stopped a job (its state in sacct), as its summary row says it.
SLURM_STOPS = {
    "TIMEOUT": "it ran past its time limit, hydra.launcher.timeout_min",
    "CANCELLED": "cancelled: scancel",
    "PREEMPTED": "preempted by another job",
    "NODE_FAIL": "its node failed",
}


def slurm_stopped(job_id: str) -> str:
    """What SLURM's accounting says of this job once SLURM has stopped it, as the
    start of its error message ("SLURM job 12_3 TIMEOUT (...): "), or "" when it
    says nothing (scontrol shows only COMPLETING while the job is stopped)."""
    try:
        shown = subprocess.run(
            ["sacct", "-n", "-X", "-P", "-o", "State", "-j", job_id], capture_output=True, text=True, timeout=15
        ).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return ""
    state = shown[0] if shown else ""
    return f"SLURM job {job_id} {state} ({SLURM_STOPS[state]}): " if state in SLURM_STOPS else ""


def _build_in_fresh_process(
    cfg: DictConfig, job_dir: Path, threads: int | None, tag: str, extra_env: dict[str, str]
) -> dict[str, Any]:
    """Run `python -m flashrt_build.sweep.build_process` on the job's resolved config, relaying
    its log lines (tagged with the job) into this job's log."""
    OmegaConf.save(cfg, job_dir / BUILD_CONFIG, resolve=True)
    (job_dir / BUILD_RESULT).unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    if threads:
        env.update(threads_env(threads))
    env.update(extra_env)  # the GPU this build holds, visible before CUDA starts
    process = subprocess.Popen(
        [sys.executable, "-m", "flashrt_build.sweep.build_process", str(job_dir)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    )
    assert process.stdout is not None
    level = logging.INFO
    for line in process.stdout:
        name, sep, message = line.rstrip("\n").partition("|")
        named = logging.getLevelName(name) if sep else None  # an int for a level's name (3.10 has no mapping)
        if isinstance(named, int):  # the build process's "LEVEL|message"
            level = named
        else:  # a continuation line (a traceback) or a library's own print
            message = line.rstrip("\n")
        log.log(level, "%s %s", tag, message)
    code = process.wait()
    result = job_dir / BUILD_RESULT
    if result.is_file():
        return json.loads(result.read_text())
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    message = f"the build process {how} before reporting a result (see the job log)"
    log.error("%s %s", tag, message)
    return {"status": "failed", "exit_code": 1, "error": {"type": "BuildProcessDied", "message": message}}


def failure(exc: BaseException, exit_code: int | None = None) -> dict[str, Any]:
    """A failed job's outcome: its exit code, the error's type and message."""
    code = exit_code if exit_code is not None else getattr(exc, "exit_code", 1)
    return {"status": "failed", "exit_code": code, "error": {"type": type(exc).__name__, "message": str(exc)}}


def _row_fields(outcome: dict[str, Any], output_dir: str | None) -> dict[str, Any]:
    """The summary's view of an outcome: status, and what the manifest says."""
    status = outcome["status"]
    fields: dict[str, Any] = {
        # "from_store": linked from an identical stored build, so up to date without building
        "status": "up_to_date" if status == "from_store" else status,
        "from_store": status == "from_store",
        "exit_code": outcome.get("exit_code", 0),
        "error": outcome.get("error"),
    }
    if status != "failed" and output_dir is not None:
        fields.update(manifest_fields(Path(output_dir)))
    return fields


def manifest_fields(output_dir: Path) -> dict[str, Any]:
    """What a sweep summary row shows of a published artifact."""
    manifest = read_manifest(output_dir)
    verification = manifest["verification"]
    outputs = verification.get("outputs") or []
    worst = max(outputs, key=lambda o: o.get("max_abs_err") or 0.0, default=None)
    bench = verification.get("bench", {}).get("ms")
    return {
        "manifest": str((output_dir / MANIFEST).resolve()),
        "package": {k: manifest["package"][k] for k in ("file", "sha256", "bytes")},
        "weights": {k: manifest["weights"].get(k) for k in ("mode", "file", "sha256", "bytes")},
        "state": {k: manifest["state"][k] for k in ("file", "sha256")} if manifest.get("state") else None,
        "build_key": manifest["build_key"],
        "graph_key": manifest.get("graph_key"),
        "timings": manifest.get("timings", {}),
        "verification": {
            "verdict": "passed" if verification.get("passed") else "off" if not verification["enabled"] else "failed",
            "worst": None
            if worst is None
            else {k: worst.get(k) for k in ("path", "max_abs_err", "rel_err", "atol", "rtol")},
        },
        "latency_ms": {name: row["median"] for name, row in bench.items()} if bench else None,
    }


def _write_record(job_dir: Path, record: dict[str, Any]) -> None:
    job_dir.mkdir(parents=True, exist_ok=True)
    tmp = job_dir / f".{RECORD}.tmp"
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(job_dir / RECORD)
