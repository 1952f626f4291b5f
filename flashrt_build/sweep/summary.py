"""The end of a sweep: one row per job on the terminal and in the sweep
directory (`sweep_summary.json`, `sweep_summary.md`), and the exit code.

A Hydra callback in the process that launched the sweep, so it works with
every launcher: it reads the record each job left in its directory.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from .job import RECORD

SCHEMA = "flashrt_build.sweep_summary/1"
SUMMARY_JSON = "sweep_summary.json"
SUMMARY_MD = "sweep_summary.md"
STATUSES = ("built", "up_to_date", "failed")

# The exit code of the last sweep this process ran (the CLI exits with it).
last_exit_code: list[int] = []


def collect_rows(sweep_dir: Path) -> list[dict[str, Any]]:
    """Every job's record, by job number; a job that never finished is failed."""
    rows = []
    for path in sweep_dir.glob(f"*/{RECORD}"):
        row = json.loads(path.read_text())
        if row["status"] == "running":
            message = "the job stopped without a result: its process was killed or crashed (see its log)"
            row.update(status="failed", exit_code=1, error={"type": "JobDied", "message": message})
        rows.append(row)
    return sorted(rows, key=lambda row: row["job"])


def exit_code(rows: list[dict[str, Any]]) -> int:
    """0 only when every job succeeded; a sweep that recorded no job failed."""
    return max((int(row["exit_code"]) for row in rows), default=1)


def summarize(sweep_dir: Path, rows: list[dict[str, Any]], launcher: str, wall_s: float | None) -> dict[str, Any]:
    counts = Counter(row["status"] for row in rows)
    return {
        "schema": SCHEMA,
        "sweep_dir": str(sweep_dir.resolve()),
        "launcher": launcher,
        "wall_s": wall_s,
        "jobs": len(rows),
        "counts": {status: counts.get(status, 0) for status in STATUSES},
        "exit_code": exit_code(rows),
        "rows": rows,
    }


def write_summary(sweep_dir: Path, summary: dict[str, Any]) -> tuple[Path, Path]:
    json_path, md_path = sweep_dir / SUMMARY_JSON, sweep_dir / SUMMARY_MD
    json_path.write_text(json.dumps(summary, indent=2) + "\n")
    md_path.write_text(render_markdown(summary))
    return json_path, md_path


def _module(row: dict[str, Any]) -> str:
    if row.get("name"):
        return str(row["name"])
    picked = [o.partition("=")[2] for o in row["overrides"] if o.lstrip("+").startswith("module=")]
    return picked[0] if picked else "?"


def _overrides(row: dict[str, Any]) -> str:
    shown = [o for o in row["overrides"] if not o.lstrip("+").startswith(("module=", "output_root="))]
    return " ".join(shown)


def _megabytes(row: dict[str, Any]) -> str:
    return f"{row['package']['bytes'] / 1e6:.2f}" if row.get("package") else ""


def _verdict(row: dict[str, Any]) -> str:
    verification = row.get("verification")
    if not verification:
        return ""
    worst = verification.get("worst")
    if verification["verdict"] == "passed" and worst:
        return f"passed, max err {worst['max_abs_err']:.1e}"
    return str(verification["verdict"])


def _latency(row: dict[str, Any]) -> str:
    ms = row.get("latency_ms")
    return ", ".join(f"{name} {value:.3f}" for name, value in ms.items()) if ms else ""


def _first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0] + (f" (+{len(lines) - 1} lines)" if len(lines) > 1 else "") if lines else ""


def _outcome(row: dict[str, Any], width: int = 140) -> str:
    """The output dir, or the error cut to `width` (the full text is in the JSON and the Failures section)."""
    if row["status"] != "failed":
        return str(row.get("output_dir", ""))
    error = row.get("error") or {}
    text = f"{error.get('type', 'Error')}: {_first_line(error.get('message', ''))}"
    return text if len(text) <= width else text[: width - 3] + "..."


def _has_slurm_ids(rows: list[dict[str, Any]]) -> bool:
    """Whether SLURM ran any job of the sweep: then each row names its SLURM job."""
    return any(row.get("slurm_job_id") for row in rows)


def _headline(summary: dict[str, Any]) -> str:
    counts = summary["counts"]
    parts = [f"{counts[s]} {s.replace('_', ' ')}" for s in STATUSES]
    wall = f" in {summary['wall_s']:.1f} s" if summary.get("wall_s") is not None else ""
    return f"{summary['jobs']} jobs: {', '.join(parts)}{wall} (exit code {summary['exit_code']})"


def render_markdown(summary: dict[str, Any]) -> str:
    rows = summary["rows"]
    slurm = _has_slurm_ids(rows)
    md = [
        "# Sweep summary",
        "",
        f"`{summary['sweep_dir']}`, launcher `{summary['launcher']}`: {_headline(summary)}",
        "",
        "| job |" + (" slurm job |" if slurm else "") + " module | overrides | status | wall s | export s "
        "| compile s | verify s | package MB | verification | latency ms | output dir or error |",
        "|---:|" + ("---|" if slurm else "") + "---|---|---|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for row in rows:
        timings = row.get("timings") or {}
        cells = [
            str(row["job"]),
            *([str(row.get("slurm_job_id") or "")] if slurm else []),
            _module(row),
            f"`{_overrides(row)}`" if _overrides(row) else "",
            row["status"] + (" (from store)" if row.get("from_store") else ""),
            f"{row.get('wall_s', 0):.1f}",
            *(
                f"{timings[stage]:.1f}" if stage in timings and row["status"] == "built" else ""
                for stage in ("export", "compile", "verify")
            ),  # fmt: skip
            _megabytes(row),
            _verdict(row),
            _latency(row),
            _outcome(row).replace("|", "\\|"),
        ]
        md.append("| " + " | ".join(cells) + " |")
    failed = [row for row in rows if row["status"] == "failed"]
    if failed:
        md += ["", "## Failures", ""]
        for row in failed:
            error = row.get("error") or {}
            md += [f"### job {row['job']}: {_module(row)} `{_overrides(row)}`", "", f"log: `{row.get('log')}`", ""]
            md += ["```", f"{error.get('type')}: {error.get('message', '').strip()}", "```", ""]
    artifacts = [row for row in rows if row.get("package")]
    if artifacts:
        md += ["", "## Artifacts", "", "| job | output dir | package sha256 | weights sha256 | build key |"]
        md.append("|---:|---|---|---|---|")
        for row in artifacts:
            weights = (row.get("weights") or {}).get("sha256") or "(baked)"
            md.append(
                f"| {row['job']} | `{row['output_dir']}` | `{row['package']['sha256']}` | `{weights}` "
                f"| `{row['build_key']}` |"
            )
    return "\n".join(md).rstrip() + "\n"


def render_table(summary: dict[str, Any]) -> str:
    """The terminal's view: one line per job, failures with their first line."""
    slurm = _has_slurm_ids(summary["rows"])
    header = ("job", *(("slurm job",) if slurm else ()), "status", "time", "module", "overrides", "MB",
              "verification", "output dir or error")  # fmt: skip
    lines = [header]
    for row in summary["rows"]:
        status = "FAILED" if row["status"] == "failed" else row["status"].replace("_", " ")
        slurm_id = (str(row.get("slurm_job_id") or "-"),) if slurm else ()
        lines.append((str(row["job"]), *slurm_id, status, f"{row.get('wall_s', 0):.1f}s", _module(row),
                      _overrides(row), _megabytes(row), _verdict(row), _outcome(row)))  # fmt: skip
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    text = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=False)) + "  " + line[-1]
            for line in lines]  # fmt: skip
    return "\n".join([f"sweep {summary['sweep_dir']}", _headline(summary), *text])


class SweepSummary(Callback):
    """Hydra callback (conf/config.yaml, hydra.callbacks): clears stale job
    records when a sweep starts; writes and prints the summary when it ends."""

    def __init__(self) -> None:
        self.started: float | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.started = time.perf_counter()
        for stale in Path(str(config.hydra.sweep.dir)).glob(f"*/{RECORD}"):  # a re-used sweep dir
            stale.unlink()

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        wall = None if self.started is None else round(time.perf_counter() - self.started, 3)
        launcher = str(config.hydra.launcher.get("_target_", "?")).rsplit(".", 1)[-1]
        summary = summarize(sweep_dir, collect_rows(sweep_dir), launcher, wall)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        json_path, md_path = write_summary(sweep_dir, summary)
        print(render_table(summary), flush=True)
        print(f"summary: {md_path} and {json_path.name}", flush=True)
        last_exit_code[:] = [summary["exit_code"]]
