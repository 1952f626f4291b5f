"""Sweeps: real Hydra multiruns through the basic, joblib and submitit_local
launchers, each with a job that fails, sharing one output root (and store)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import flashrt_build
from flashrt_build.cache.plan import make_plan
from flashrt_build.config.compose import compose
from flashrt_build.config.spec import resolve_spec
from flashrt_build.errors import ConfigError
from flashrt_build.runtime.hashing import file_sha256
from flashrt_build.runtime.manifest import read_manifest
from flashrt_build.stages.threads import apply_threads, available_cpus, job_threads
from flashrt_build.sweep import gpus
from flashrt_build.sweep.job import RECORD
from flashrt_build.sweep.summary import SUMMARY_JSON, SUMMARY_MD, collect_rows, exit_code, render_markdown, summarize

REPO = Path(__file__).resolve().parents[2]
TEST_CONF = Path(__file__).resolve().parents[1] / "conf"  # once_per_process, export_fails
JOBLIB = "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"
SLURM = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
BASIC = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"


def sweep(sweep_dir: Path, output_root: Path, *overrides: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    """Run a multirun through the CLI; return the process and its summary."""
    command = [sys.executable, "-m", "flashrt_build", "-m", "--config-dir", str(TEST_CONF), *overrides]
    command += [f"output_root={output_root}", f"hydra.sweep.dir={sweep_dir}"]
    env = {**os.environ, "HYDRA_FULL_ERROR": "", "FLASHRT_TRACEBACK": ""}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    summary_path = sweep_dir / SUMMARY_JSON
    assert summary_path.is_file(), result.stderr[-3000:]
    return result, json.loads(summary_path.read_text())


def by_overrides(summary: dict) -> dict[str, dict[str, Any]]:
    return {" ".join(row["overrides"][:-1]): row for row in summary["rows"]}  # without output_root


def assert_built_and_indexed(row: dict[str, Any]) -> None:
    """The summary row points at a verified artifact whose digests it records."""
    assert row["status"] in ("built", "up_to_date"), row
    assert row["exit_code"] == 0 and row["error"] is None
    output_dir = Path(row["output_dir"])
    manifest = read_manifest(output_dir)
    assert Path(row["manifest"]) == output_dir / "manifest.json"
    assert manifest["verification"]["passed"] is True and row["verification"]["verdict"] == "passed"
    assert row["verification"]["worst"]["max_abs_err"] <= row["verification"]["worst"]["atol"] + 1e-3
    assert row["package"]["sha256"] == file_sha256(output_dir / "model.pt2") == manifest["package"]["sha256"]
    assert row["build_key"] == manifest["build_key"]
    if manifest["weights"]["mode"] == "external":
        assert row["weights"]["sha256"] == file_sha256(output_dir / "weights.safetensors")
    flashrt_build.load(output_dir)  # loads: digests checked, weights bound
    assert Path(row["log"]).is_file() and Path(row["overrides_file"]).is_file()
    assert [line.lstrip("- ") for line in Path(row["overrides_file"]).read_text().splitlines()] == row["overrides"]


def assert_failed_with_cause(row: dict[str, Any]) -> None:
    assert row["status"] == "failed" and row["exit_code"] == 1
    assert row["error"]["type"] == "ExportError" and "DataDependentBranch" in row["error"]["message"]
    assert "package" not in row  # nothing published
    assert "ExportError" in Path(row["log"]).read_text()  # the job's log has its build's lines


@pytest.fixture(scope="module")
def sweep_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sweeps")


@pytest.fixture(scope="module")
def basic_sweep(sweep_root: Path) -> tuple[subprocess.CompletedProcess[str], dict]:
    overrides = ("+module=mlp,export_fails", "weights=baked,external")
    return sweep(sweep_root / "basic", sweep_root / "out", *overrides)


@pytest.mark.slow
def test_basic_sweep_builds_everything_it_can_and_exits_non_zero(basic_sweep: tuple) -> None:
    result, summary = basic_sweep
    assert result.returncode == 1
    assert summary["jobs"] == 4 and summary["counts"] == {"built": 2, "up_to_date": 0, "failed": 2}
    assert summary["exit_code"] == 1 and summary["launcher"] == "BasicLauncher"
    rows = by_overrides(summary)
    assert set(rows) == {f"+module={m} weights={w}" for m in ("mlp", "export_fails") for w in ("baked", "external")}
    for weights in ("baked", "external"):
        row = rows[f"+module=mlp weights={weights}"]
        assert_built_and_indexed(row)
        assert {"export", "compile", "verify"} <= set(row["timings"])
        assert Path(row["output_dir"]).name == f"cpu-{weights}-default"
        assert_failed_with_cause(rows[f"+module=export_fails weights={weights}"])
    # The terminal table lists every job; the markdown file every job and every failure in full.
    table = result.stdout
    assert table.count("FAILED") == 2 and "4 jobs: 2 built, 0 up to date, 2 failed" in table
    markdown = (Path(summary["sweep_dir"]) / SUMMARY_MD).read_text()
    assert markdown.count("| built |") == 2 and markdown.count("### job") == 2
    assert all(row["build_key"] in markdown for row in summary["rows"] if row["status"] == "built")


@pytest.mark.slow
def test_a_finished_sweep_rerun_skips_what_is_up_to_date(basic_sweep: tuple, sweep_root: Path) -> None:
    first = {row["job"]: row for row in basic_sweep[1]["rows"]}
    start = time.perf_counter()
    result, summary = sweep(
        sweep_root / "rerun", sweep_root / "out", "+module=mlp,export_fails", "weights=baked,external"
    )
    elapsed = time.perf_counter() - start
    assert result.returncode == 1
    assert summary["counts"] == {"built": 0, "up_to_date": 2, "failed": 2}
    for row in summary["rows"]:
        if row["status"] == "up_to_date":
            assert row["package"]["sha256"] == first[row["job"]]["package"]["sha256"]
            assert row["wall_s"] < 2.0, row  # no build process was started
    assert elapsed < sum(row["wall_s"] for row in first.values()), "the re-run did work it could skip"


@pytest.mark.slow
def test_joblib_sweep_isolates_each_build_and_bounds_threads(sweep_root: Path) -> None:
    # One worker runs all four jobs: without a fresh process per build the
    # second once_per_process build would raise in its constructor.
    result, summary = sweep(
        sweep_root / "joblib",
        sweep_root / "out",
        "hydra/launcher=parallel",
        "hydra.launcher.n_jobs=1",
        "+module=once_per_process,export_fails",
        "weights=external",
        "seed=1,2",
    )
    assert result.returncode == 1, result.stderr[-2000:]
    assert summary["launcher"] == "JoblibLauncher" and summary["jobs"] == 4
    rows = by_overrides(summary)
    for seed in (1, 2):
        assert_built_and_indexed(rows[f"+module=once_per_process weights=external seed={seed}"])
        assert_failed_with_cause(rows[f"+module=export_fails weights=external seed={seed}"])
    assert {row["threads"] for row in summary["rows"]} == {available_cpus()}  # one job at a time: all cores


@pytest.mark.slow
def test_submitit_local_sweep(sweep_root: Path) -> None:
    result, summary = sweep(
        sweep_root / "submitit",
        sweep_root / "out",
        "hydra/launcher=slurm_local",
        "+module=once_per_process,export_fails",
        "weights=external",
        "seed=3",
    )
    assert result.returncode == 1, result.stderr[-2000:]
    assert summary["launcher"] == "LocalLauncher"
    assert summary["counts"] == {"built": 1, "up_to_date": 0, "failed": 1}
    rows = by_overrides(summary)
    assert_built_and_indexed(rows["+module=once_per_process weights=external seed=3"])
    assert rows["+module=once_per_process weights=external seed=3"]["threads"] == 1  # cpus_per_task
    assert_failed_with_cause(rows["+module=export_fails weights=external seed=3"])
    assert (sweep_root / "submitit" / ".submitit").is_dir()  # submitit really submitted the jobs


@pytest.mark.slow
def test_a_job_whose_build_is_stopped_says_interrupted_and_its_sweep_goes_on(tmp_path: Path) -> None:
    """SIGTERM to one job's build process (a cluster's cancel, a user's kill) was summarised as
    'BuildProcessDied: ... exited with code 143'; the job was interrupted, and says so."""
    sweep_dir, out = tmp_path / "sweep", tmp_path / "out"
    command = [sys.executable, "-m", "flashrt_build", "-m", "+module=mlp", f"output_root={out}"]
    env = {**os.environ, "HYDRA_FULL_ERROR": "", "FLASHRT_TRACEBACK": ""}
    proc = subprocess.Popen(
        [*command, f"hydra.sweep.dir={sweep_dir}"], cwd=REPO, env=env, stderr=subprocess.PIPE, text=True
    )
    assert proc.stderr is not None
    for line in proc.stderr:
        if "[job 0] export " in line:  # the build process is compiling
            os.kill(_build_process_of(sweep_dir), signal.SIGTERM)
            break
    rest = proc.stderr.read()
    assert proc.wait(timeout=300) == 143, rest  # a sweep exits with its worst job's code
    (row,) = json.loads((sweep_dir / SUMMARY_JSON).read_text())["rows"]
    assert row["status"] == "failed" and row["exit_code"] == 143
    assert row["error"] == {
        "type": "Interrupted",
        "message": "interrupted by SIGTERM: nothing was published; an earlier artifact at the output directory "
        "is as it was",
    }
    assert not list(out.rglob(".staging-*")) and not list(out.rglob("model.pt2"))


def _build_process_of(sweep_dir: Path) -> int:
    """The pid of the sweep's build process (its job directory is under `sweep_dir`)."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            args = cmdline.read_bytes().split(b"\0")
            if b"flashrt_build.sweep.build_process" in args and str(sweep_dir).encode() in b" ".join(args):
                return int(cmdline.parent.name)
    raise AssertionError(f"no build process of {sweep_dir} is running")


@pytest.mark.slow
def test_glob_sweeps_every_matching_module_and_a_config_error_fails_only_its_job(tmp_path: Path) -> None:
    # An unimportable target is refused before any build starts: every job fails fast, none stops the others.
    result, summary = sweep(
        tmp_path / "s", tmp_path / "out", "+module=glob(*_tiny)", "module.model._target_=nope.A,nope.B"
    )
    assert result.returncode == 2
    rows = {" ".join(row["overrides"][:2]): row for row in summary["rows"]}
    tiny = sorted(p.stem for p in (REPO / "conf" / "module").glob("*_tiny.yaml"))
    assert {"bert_tiny", "gpt2_tiny"} <= set(tiny)
    expected = {f"+module={m} module.model._target_=nope.{t}" for m in tiny for t in "AB"}
    assert set(rows) == expected and summary["counts"]["failed"] == 2 * len(tiny)
    assert all(row["exit_code"] == 2 and "module.model._target_" in row["error"]["message"] for row in rows.values())


@pytest.mark.slow
def test_every_job_of_a_sweep_is_checked_before_it_builds(mlp_build: flashrt_build.BuildResult, tmp_path: Path) -> None:
    good = tmp_path / "good"
    shutil.copytree(mlp_build.output_dir, good)  # the same build key: up to date, nothing to compile
    result, summary = sweep(tmp_path / "s1", tmp_path / "out", "+module=mlp", f"output_dir={good},/proc/forbidden")
    assert result.returncode == 2 and summary["counts"] == {"built": 0, "up_to_date": 1, "failed": 1}
    rows = {row["overrides"][1]: row for row in summary["rows"]}
    assert rows[f"output_dir={good}"]["status"] == "up_to_date"
    bad = rows["output_dir=/proc/forbidden"]
    assert bad["exit_code"] == 2 and bad["error"]["type"] == "ConfigError"
    assert "config key 'output_dir' = '/proc/forbidden': cannot be written" in bad["error"]["message"]
    # A typo'd key fails every job, each saying which key and what was meant; nothing is built.
    result, summary = sweep(tmp_path / "s2", tmp_path / "out", "+module=mlp", "seed=0,1", "++verify.repet=2")
    assert result.returncode == 2 and summary["counts"]["failed"] == 2
    for row in summary["rows"]:
        assert (
            row["exit_code"] == 2
            and "'verify.repet' = 2: not a config key; did you mean verify.repeat?" in (row["error"]["message"])
        )
    assert not (tmp_path / "out").exists()  # no job got as far as creating its output root


def test_once_per_process_fails_when_a_process_builds_it_twice() -> None:
    """The isolation test's module does detect a shared process."""
    import modules

    modules._once_per_process_built = 0
    modules.OncePerProcess()
    with pytest.raises(RuntimeError, match="constructed 2 times"):
        modules.OncePerProcess()
    modules._once_per_process_built = 0


@pytest.mark.parametrize(
    ("launcher", "cpus", "expected"),
    [
        ({"_target_": JOBLIB, "n_jobs": 2}, 2, 1),
        ({"_target_": JOBLIB, "n_jobs": 4}, 16, 4),
        ({"_target_": JOBLIB, "n_jobs": -1}, 16, 1),  # joblib: one job per core
        ({"_target_": JOBLIB, "n_jobs": -2}, 8, 1),  # all cores but one
        ({"_target_": JOBLIB, "n_jobs": 32}, 2, 1),  # more jobs than cores: still one thread
        ({"_target_": JOBLIB, "n_jobs": 1}, 8, 8),
        ({"_target_": SLURM, "cpus_per_task": 8}, 64, 8),
        ({"_target_": BASIC}, 8, None),  # one job at a time: all cores
    ],
)
def test_each_job_gets_its_share_of_the_cores(launcher: dict, cpus: int, expected: int | None) -> None:
    assert job_threads(launcher, cpus) == expected


def test_a_thread_limit_bounds_compile_workers_not_the_generated_code(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    import torch._inductor.config as inductor_config

    for name in ("TORCHINDUCTOR_COMPILE_THREADS", "FLASHRT_THREADS"):
        monkeypatch.delenv(name, raising=False)
    before = torch.get_num_threads()
    # config.patch restores the option (monkeypatch's undo deleted it from Inductor's config: a later
    # in-process compile in this worker then failed, "compile_threads does not exist")
    with inductor_config.patch(compile_threads=inductor_config.compile_threads):
        apply_threads(1)
        assert inductor_config.compile_threads == 1 and os.environ["FLASHRT_THREADS"] == "1"
    # Inductor sizes its CPU kernels' parallel loops by this count: it must not change.
    assert torch.get_num_threads() == before


def test_threads_is_checked_and_changes_neither_key_nor_directory() -> None:
    plain = resolve_spec(compose(["+module=mlp"]))
    threaded = resolve_spec(compose(["+module=mlp", "threads=3"]))
    assert threaded.threads == 3 and threaded.output_dir == plain.output_dir
    assert make_plan(compose(["+module=mlp", "threads=3"])).keys == make_plan(compose(["+module=mlp"])).keys
    assert compose(["+module=mlp", "threads=3", "seed=2"]).variant == "seed_2"
    with pytest.raises(ConfigError, match="'threads' = 0"):
        resolve_spec(compose(["+module=mlp", "threads=0"]))


def _record(job: int, status: str, **extra: Any) -> dict[str, Any]:
    return {"job": job, "overrides": [f"+module=m{job}", "weights=baked"], "status": status, "exit_code": 0, **extra}


def test_summary_reports_a_job_that_died_as_failed_and_the_exit_code(tmp_path: Path) -> None:
    records = [
        _record(1, "built", output_dir="/o/m1", wall_s=3.0),
        _record(0, "up_to_date", output_dir="/o/m0", wall_s=0.1),
        _record(2, "running"),  # its process was killed before it could finish
    ]
    for record in records:
        (tmp_path / str(record["job"])).mkdir()
        (tmp_path / str(record["job"]) / RECORD).write_text(json.dumps(record))
    rows = collect_rows(tmp_path)
    assert [row["job"] for row in rows] == [0, 1, 2]
    assert rows[2]["status"] == "failed" and rows[2]["error"]["type"] == "JobDied"
    assert exit_code(rows) == 1 and exit_code(rows[:2]) == 0 and exit_code([]) == 1
    summary = summarize(tmp_path, rows, "BasicLauncher", 4.5)
    assert summary["counts"] == {"built": 1, "up_to_date": 1, "failed": 1}
    markdown = render_markdown(summary)
    assert "| 2 | m2 |" in markdown and "JobDied" in markdown and "## Failures" in markdown


def test_summary_markdown_keeps_error_text_out_of_the_table_structure() -> None:
    error = {"type": "ExportError", "message": "a | b\nsecond line"}
    row = _record(0, "failed", exit_code=1, error=error, wall_s=1.0)
    markdown = render_markdown(summarize(Path("/s"), [row], "BasicLauncher", None))
    table_row = next(line for line in markdown.splitlines() if line.startswith("| 0 |"))
    assert "a \\| b (+1 lines)" in table_row and table_row.count(" | ") == 11
    assert "second line" in markdown  # in full under Failures


# ---- GPUs shared by the jobs of a sweep (a fake device count: no GPU needed) ----


@pytest.fixture
def gpu_locks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(gpus, "LOCK_DIR", tmp_path / "locks")
    return tmp_path / "locks"


def test_each_gpu_is_held_by_one_build_at_a_time(gpu_locks: Path) -> None:
    waits: list[float] = []

    def give_up(seconds: float) -> None:
        waits.append(seconds)
        raise TimeoutError

    with gpus.gpu_slot("cpu", ["0", "1"]) as cpu:
        assert cpu is None  # CPU targets hold no GPU
    with gpus.gpu_slot("cuda", ["0", "1"]) as first, gpus.gpu_slot("cuda", ["0", "1"]) as second:
        assert first == {"CUDA_VISIBLE_DEVICES": "0", "FLASHRT_GPU": "0"}
        assert second == {"CUDA_VISIBLE_DEVICES": "1", "FLASHRT_GPU": "1"}
        with pytest.raises(TimeoutError), gpus.gpu_slot("cuda", ["0", "1"], sleep=give_up):
            pass  # both held: a third build waits
        assert waits == [0.5]
    with gpus.gpu_slot("cuda:1", ["0", "1"]) as pinned:
        assert pinned == {"FLASHRT_GPU": "1"}  # an explicit index names its GPU itself
        with gpus.gpu_slot("cuda", ["0", "1"]) as other:
            assert other is not None and other["FLASHRT_GPU"] == "0"


def test_visible_gpus_from_a_fake_count_or_the_visible_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASHRT_GPUS", "3")
    assert gpus.visible_gpus() == ["0", "1", "2"]
    monkeypatch.delenv("FLASHRT_GPUS")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 5")
    assert gpus.visible_gpus() == ["2", "5"]


@pytest.mark.slow
def test_a_parallel_cuda_sweep_spreads_jobs_over_the_gpus_one_at_a_time(tmp_path: Path) -> None:
    """Four CUDA jobs, three at once, two (fake) GPUs. Without a GPU every build
    fails at its device check, after holding its GPU: the records show which
    GPU each job held and when."""
    env = {**os.environ, "FLASHRT_GPUS": "2"}
    command = [sys.executable, "-m", "flashrt_build", "-m", "hydra/launcher=parallel", "hydra.launcher.n_jobs=3"]
    command += ["+module=mlp", "target=cuda", "seed=1,2,3,4"]
    command += [f"output_root={tmp_path}", f"hydra.sweep.dir={tmp_path}/s"]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]  # no CUDA here: a config error per job
    rows = json.loads((tmp_path / "s" / SUMMARY_JSON).read_text())["rows"]
    assert len(rows) == 4 and {row["gpu"] for row in rows} == {"0", "1"}
    assert all("no CUDA device" in row["error"]["message"] for row in rows)
    for gpu in ("0", "1"):
        spans = sorted((row["build_started_at"], row["build_finished_at"]) for row in rows if row["gpu"] == gpu)
        assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:], strict=False)), spans


@pytest.mark.parametrize(
    ("launcher", "target", "expected"),
    [
        ("parallel", "JoblibLauncher", {"n_jobs": min(available_cpus(), 8)}),
        ("slurm", "SlurmLauncher", {"gpus_per_node": 1, "cpus_per_task": 8, "array_parallelism": 16, "mem_gb": 64}),
        ("slurm_local", "LocalLauncher", {"cpus_per_task": 1, "gpus_per_node": 0}),
    ],
)
def test_shipped_launcher_configs_compose_onto_the_plugins(launcher: str, target: str, expected: dict) -> None:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    import flashrt_build.cli  # noqa: F401  registers the resolver parallel.yaml uses
    from flashrt_build.config.compose import CONF_DIR
    from flashrt_build.config.schema import register_schema

    register_schema()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose("config", overrides=["+module=mlp", f"hydra/launcher={launcher}"], return_hydra_config=True)
    resolved = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert resolved["_target_"].endswith(target)
    assert {key: resolved[key] for key in expected} == expected
