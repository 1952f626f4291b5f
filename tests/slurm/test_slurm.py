"""Sweeps through the shipped `hydra/launcher=slurm` on a real one-node
SLURM cluster (cluster.sh): each test asserts what SLURM's accounting
(`sacct`) says of the jobs, and what the sweep's summary and the store say.

The tests share one output root (and its store), in order: the sweep of
three builds comes first, later sweeps find its packages up to date.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import flashrt_build
from flashrt_build.runtime.hashing import file_sha256
from flashrt_build.runtime.manifest import read_manifest
from flashrt_build.sweep.summary import SUMMARY_JSON, SUMMARY_MD

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
CONF = Path(__file__).resolve().parent / "conf"  # sleeps, bad_target
PARTITION = os.environ.get("FLASHRT_SLURM_PARTITION", "")
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED")


def sweep_command(sweep_dir: Path, output_root: Path, *overrides: str, timeout_min: int = 10) -> list[str]:
    """A multirun through the shipped slurm launcher, pointed at the test partition, CPU-sized."""
    launcher = [
        "hydra/launcher=slurm",
        f"hydra.launcher.partition={PARTITION}",
        "hydra.launcher.gpus_per_node=0",
        "hydra.launcher.cpus_per_task=1",
        "hydra.launcher.mem_gb=2",
        f"hydra.launcher.timeout_min={timeout_min}",
    ]
    return [sys.executable, "-m", "flashrt_build", "-m", "--config-dir", str(CONF), *launcher, *overrides,
            f"output_root={output_root}", f"hydra.sweep.dir={sweep_dir}"]  # fmt: skip


def start_sweep(sweep_dir: Path, output_root: Path, *overrides: str, timeout_min: int = 10) -> subprocess.Popen[str]:
    env = {**os.environ, "HYDRA_FULL_ERROR": "", "FLASHRT_TRACEBACK": ""}
    command = sweep_command(sweep_dir, output_root, *overrides, timeout_min=timeout_min)
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen[str], sweep_dir: Path) -> tuple[int, str, dict[str, Any]]:
    """Wait for a sweep; its exit code, terminal output and summary."""
    out, err = proc.communicate(timeout=600)
    summary_path = sweep_dir / SUMMARY_JSON
    assert summary_path.is_file(), f"no summary; exit code {proc.returncode}\n{out[-3000:]}\n{err[-5000:]}"
    return proc.returncode, out, json.loads(summary_path.read_text())


def run_sweep(sweep_dir: Path, output_root: Path, *overrides: str, timeout_min: int = 10) -> tuple[int, str, dict]:
    return finish(start_sweep(sweep_dir, output_root, *overrides, timeout_min=timeout_min), sweep_dir)


def sacct(job_id: str, timeout: float = 180) -> dict[str, str]:
    """SLURM's accounting record of a job (an array task `12_3` too), once it has ended:
    a job's process can end a few seconds before SLURM records the job as ended."""
    deadline = time.monotonic() + timeout
    while True:
        listed = subprocess.run(
            ["sacct", "-n", "-X", "-P", "-o", "JobID,State,ExitCode,Start,End,Timelimit", "-j", job_id],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert listed.returncode == 0, listed.stderr  # accounting is up: sacct answers
        rows = [line.split("|") for line in listed.stdout.splitlines() if line.split("|")[0] == job_id]
        if rows:
            record = dict(zip(("JobID", "State", "ExitCode", "Start", "End", "Timelimit"), rows[0], strict=True))
            record["State"] = record["State"].split()[0]  # "CANCELLED by 0"
            if record["State"] in FINAL:
                return record
        assert time.monotonic() < deadline, f"job {job_id} has not ended in sacct after {timeout}s: {rows}"
        time.sleep(2)


def rows_by_seed(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {" ".join(o for o in row["overrides"] if not o.startswith("output_root=")): row for row in summary["rows"]}


def assert_verified_package(row: dict[str, Any]) -> None:
    """The row points at a published, verified package that loads."""
    assert row["exit_code"] == 0 and row["error"] is None, row
    output_dir = Path(row["output_dir"])
    manifest = read_manifest(output_dir)
    assert manifest["verification"]["passed"] is True and row["verification"]["verdict"] == "passed"
    assert row["package"]["sha256"] == file_sha256(output_dir / "model.pt2") == manifest["package"]["sha256"]
    flashrt_build.load(output_dir)


def store_artifacts(output_root: Path) -> set[str]:
    return {p.parent.name for p in output_root.glob(".store/artifacts/*/manifest.json")}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The cluster runs the jobs as this user on this node: they see the same folders.
    return tmp_path_factory.mktemp("slurm")


@pytest.fixture(scope="module")
def three_builds(root: Path) -> tuple[int, str, dict[str, Any]]:
    return run_sweep(root / "three", root / "out", "+module=mlp", "seed=11,12,13")


def test_a_sweep_of_three_builds_three_verified_packages_each_job_completed_in_sacct(
    three_builds: tuple[int, str, dict[str, Any]], root: Path
) -> None:
    code, table, summary = three_builds
    assert code == 0, table
    assert summary["launcher"] == "SlurmLauncher"
    assert summary["counts"] == {"built": 3, "up_to_date": 0, "failed": 0}
    ids = [row["slurm_job_id"] for row in summary["rows"]]
    assert len(set(ids)) == 3 and len({i.split("_")[0] for i in ids}) == 1  # one job array, a task per build
    markdown = (root / "three" / SUMMARY_MD).read_text()
    for row in summary["rows"]:
        assert_verified_package(row)
        assert sacct(row["slurm_job_id"])["State"] == "COMPLETED"
        line = next(line for line in table.splitlines() if line.startswith(f"{row['job']} "))
        assert row["slurm_job_id"] in line.split() and row["slurm_job_id"] in markdown  # the summary names it
    # What landed on the cluster: one sbatch script for the array, pointed at the test partition.
    (script,) = (root / "three" / ".submitit").glob("*/*_submission.sh")
    text = script.read_text()
    assert f"#SBATCH --partition={PARTITION}" in text and "#SBATCH --array=0-2" in text


def test_a_failing_job_is_failed_in_sacct_says_why_and_sets_the_sweeps_exit_code(
    three_builds: tuple[int, str, dict[str, Any]], root: Path
) -> None:
    code, table, summary = run_sweep(root / "failing", root / "out", "+module=mlp,bad_target", "seed=11")
    rows = rows_by_seed(summary)
    bad, good = rows["+module=bad_target seed=11"], rows["+module=mlp seed=11"]
    assert bad["status"] == "failed" and bad["exit_code"] == 2  # a config error
    assert bad["error"]["type"] == "ConfigError" and "slurm_modules.NoSuchModule" in bad["error"]["message"]
    assert "NoSuchModule" in next(line for line in table.splitlines() if line.startswith(f"{bad['job']} "))
    assert sacct(bad["slurm_job_id"])["State"] == "FAILED"
    assert sacct(bad["slurm_job_id"])["ExitCode"] == "2:0"
    assert good["status"] == "up_to_date"  # built by the first sweep, in the same store
    assert_verified_package(good)
    assert sacct(good["slurm_job_id"])["State"] == "COMPLETED"
    assert code == summary["exit_code"] == 2  # the worst job's


def test_a_cancelled_job_is_interrupted_publishes_nothing_and_a_rerun_builds_only_it(
    three_builds: tuple[int, str, dict[str, Any]], root: Path
) -> None:
    out, sweep_dir = root / "out", root / "cancel"
    stored = store_artifacts(out)
    proc = start_sweep(sweep_dir, out, "+module=mlp", "seed=11,14")
    staging_pattern = "mlp/.staging-cpu-baked-default-seed_14*"
    deadline = time.monotonic() + 400
    while not list(out.glob(staging_pattern)):  # seed=14's build is under way
        assert proc.poll() is None and time.monotonic() < deadline, "seed=14 never started building"
        time.sleep(0.2)
    record = json.loads((sweep_dir / "1" / "flashrt_job.json").read_text())
    assert record["overrides"][:2] == ["+module=mlp", "seed=14"]
    subprocess.run(["scancel", record["slurm_job_id"]], check=True, timeout=60)
    code, _, summary = finish(proc, sweep_dir)

    assert sacct(record["slurm_job_id"])["State"] == "CANCELLED"
    row = rows_by_seed(summary)["+module=mlp seed=14"]
    assert row["status"] == "failed" and row["exit_code"] == 143 and row["slurm_job_id"] == record["slurm_job_id"]
    assert row["error"]["type"] == "Interrupted"
    assert row["error"]["message"].startswith(f"SLURM job {record['slurm_job_id']} CANCELLED")
    assert "nothing was published" in row["error"]["message"]
    assert code == 143
    assert not list(out.glob(staging_pattern)) and not (out / "mlp" / "cpu-baked-default-seed_14").exists()
    assert store_artifacts(out) == stored  # nothing of it reached the store

    code, _, rerun = run_sweep(root / "cancel-rerun", out, "+module=mlp", "seed=11,14")
    assert code == 0
    rows = rows_by_seed(rerun)
    assert rows["+module=mlp seed=11"]["status"] == "up_to_date"
    assert rows["+module=mlp seed=14"]["status"] == "built"
    assert_verified_package(rows["+module=mlp seed=14"])


def test_a_job_past_its_time_limit_is_stopped_by_slurm_and_its_row_says_so(root: Path) -> None:
    # sleeps.yaml's model takes 10 minutes to construct; the job may run 1.
    code, table, summary = run_sweep(root / "timeout", root / "out", "+module=sleeps", timeout_min=1)
    (row,) = summary["rows"]
    accounting = sacct(row["slurm_job_id"])
    assert accounting["State"] == "TIMEOUT" and accounting["Timelimit"] == "00:01:00"
    assert row["status"] == "failed" and row["exit_code"] == 143 and code == 143
    assert row["error"]["type"] == "Interrupted"
    assert row["error"]["message"].startswith(f"SLURM job {row['slurm_job_id']} TIMEOUT (it ran past its time limit")
    assert "TIMEOUT" in table
    assert not (root / "out" / "sleeps" / "cpu-baked-default").exists()
    assert not list((root / "out").glob("sleeps/.staging-*"))


def test_two_jobs_of_one_config_build_once_through_the_shared_store(root: Path) -> None:
    # Two sweeps at once, each a job of the same config into the same output root (a sweep itself
    # refuses two jobs of one output directory): SLURM runs the two side by side.
    procs = [start_sweep(root / f"shared-{n}", root / "out", "+module=mlp", "seed=15") for n in (1, 2)]
    results = [finish(proc, root / f"shared-{n}") for n, proc in zip((1, 2), procs, strict=True)]
    assert [code for code, _, _ in results] == [0, 0]
    rows = [summary["rows"][0] for _, _, summary in results]
    assert sorted(row["status"] for row in rows) == ["built", "up_to_date"]
    assert rows[0]["output_dir"] == rows[1]["output_dir"]
    assert rows[0]["package"]["sha256"] == rows[1]["package"]["sha256"]
    assert_verified_package(rows[0])
    waiter = next(row for row in rows if row["status"] == "up_to_date")
    assert "waiting for another build" in Path(waiter["log"]).read_text()  # it held off while the other built
    # SLURM ran the two at once, as processes of two jobs.
    jobs = [sacct(row["slurm_job_id"]) for row in rows]
    assert [job["State"] for job in jobs] == ["COMPLETED", "COMPLETED"]
    assert max(job["Start"] for job in jobs) < min(job["End"] for job in jobs)
