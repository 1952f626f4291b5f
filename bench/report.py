"""What every bench script shares: variants timed alternately in rounds, and
a markdown table printed and written to bench/results/ under a title and the
command that produced it (BENCHMARKS.md quotes these files).

Bench scripts run as `python bench/NAME.py`, which puts this folder on sys.path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
REPO = RESULTS.parent.parent


def alternate(variants: Mapping[str, Callable[[], float]], rounds: int, rotate: bool = True) -> dict[str, list[float]]:
    """Each variant's measurement once per round, side by side; the order
    rotates every round (`rotate`) so no variant always runs first."""
    names = list(variants)
    measured: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)] if rotate else names
        for name in order:
            measured[name].append(variants[name]())
    return measured


def table(header: Sequence[str], rows: Iterable[Sequence[object]], align: str = "") -> str:
    """A markdown table; `align` holds one letter per column, `r` right-aligns it."""
    rule = ["---:" if align[i : i + 1] == "r" else "---" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def publish(out: Path, title: str, command: str, text: str) -> None:
    """Print `text` and write it to `out` under `# title` and the command."""
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# {title}\n\nCommand: `{command}`\n\n{text}")


class BuildFailed(SystemExit):
    """The CLI's build failed; `error` is its last ERROR line (what a bench
    that measures the other builds reports for this one)."""

    def __init__(self, code: int, error: str) -> None:
        super().__init__(f"the build failed ({code}): {error}")
        self.error = error


def cli_build(overrides: Sequence[str], root: str | Path) -> tuple[Path, dict, float]:
    """Build through the real CLI into `root` (or the `output_dir=` among
    `overrides`): (output directory, manifest, seconds). Its log passes
    through; a failure raises BuildFailed."""
    import json
    import subprocess
    import sys
    import time

    start = time.perf_counter()
    command = [sys.executable, "-m", "flashrt_build", *overrides, f"output_root={root}"]
    error = ""
    with subprocess.Popen(command, cwd=REPO, stderr=subprocess.PIPE, text=True) as build:
        assert build.stderr is not None
        for line in build.stderr:
            sys.stderr.write(line)
            if "[ERROR] - " in line or line.startswith("error:"):
                error = line.split("[ERROR] - ", 1)[-1].strip()
    if build.returncode:
        raise BuildFailed(build.returncode, error or "see its log above")
    seconds = time.perf_counter() - start
    given = [o.partition("=")[2] for o in overrides if o.startswith("output_dir=")]
    out = (
        Path(given[-1])
        if given
        else next(p.parent for p in Path(root).rglob("manifest.json") if ".store" not in p.parts)
    )
    return out, json.loads((out / "manifest.json").read_text()), seconds


def build_root(work: str | None) -> AbstractContextManager[str]:
    """Where a bench builds: `work` when given (kept, so a later run finds its
    builds in the cache and a run split over several commands repeats no
    compile), else a temporary directory removed afterwards."""
    import tempfile

    if work:
        Path(work).mkdir(parents=True, exist_ok=True)
        return nullcontext(str(Path(work).resolve()))
    return tempfile.TemporaryDirectory()


def memory_used(device: str) -> int:
    """Bytes in use: on a GPU by every allocator (AOTInductor's constants
    bypass torch's), after freeing torch's cache; on the CPU this process's
    resident set."""
    import gc

    gc.collect()
    if not device.startswith("cuda"):
        return int(next(line for line in open("/proc/self/status") if line.startswith("VmRSS")).split()[1]) * 1024
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return total - free
