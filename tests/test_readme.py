"""The README's tutorial and its LLM guide, run as written: their files
written, their commands run in order in an empty folder, each printing what
the README shows (timings, digests and paths aside). A README that drifted
from the tool fails here."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
TUTORIAL, LLM_GUIDE = "## Ten minutes with your own model", "## Serve your LLM"
SHOWN_DIRS = {TUTORIAL: "/tmp/tutorial", LLM_GUIDE: "/tmp/llm"}  # where the README says each ran


def blocks_of(heading: str) -> list[tuple[str, str, str]]:
    """(kind, first line, body) of each fenced block of a README section, in order."""
    text = (REPO / "README.md").read_text()
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    return [
        (kind, body.split("\n", 1)[0], body) for kind, body in re.findall(r"```(\w+)\n(.*?)```", section, flags=re.S)
    ]


def normal(line: str) -> str:
    """A line of output without what differs between runs: the log's
    timestamp, numbers, digests, temporary names."""
    line = re.sub(r"^\[[^\]]*\]\[([^\]]*)\]", r"[\1]", line)
    line = re.sub(r"flashrt-repro-\w+", "flashrt-repro-X", line)
    line = re.sub(r"\b[0-9a-f]{12,}\b", "HEX", line)
    line = re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "N", line)
    line = re.sub(r"\bthreads?\b", "threads", line)  # how many a busy machine gives: 1 thread, 2 threads
    return " ".join(line.split())


def run(command: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    bin_dir = str(Path(sys.executable).parent)  # flashrt-build and python, as an activated venv gives them
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = os.pathsep.join([bin_dir, env.get("PATH", "")])
    return subprocess.run(  # one stream, in the order printed, as a terminal shows it
        ["bash", "-c", command], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=600,
    )  # fmt: skip


def run_as_written(heading: str, project: Path) -> int:
    """Write the section's files into `project` and run its commands there, in
    order, each printing the lines the README shows; the commands run."""
    shown_dir = SHOWN_DIRS[heading]
    blocks = blocks_of(heading)
    assert blocks, f"the README has no {heading!r}"
    ran = 0
    for kind, first, body in blocks:
        if kind in ("python", "yaml") and first.startswith("# "):  # a file: its path in the first line
            path = project / first[2:].strip()
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(body)
            continue
        assert kind == "console", f"a block that is neither a file nor commands: {first}"
        commands = re.split(r"(?m)^\$ ", body)[1:]
        for chunk in commands:
            command, _, shown = chunk.partition("\n")
            done = run(command.replace(shown_dir, str(project)), project)
            output = done.stdout.replace(str(project), shown_dir)
            assert done.returncode == 0, f"$ {command}\n{output[-3000:]}"
            assert "No CUDA runtime is found" not in output
            real = [normal(line) for line in output.splitlines()]
            at = 0
            for line in filter(None, (normal(s) for s in shown.splitlines())):
                assert line in real[at:], f"$ {command}: the README shows {line!r}, not in:\n{output[-3000:]}"
                at = real.index(line, at) + 1
            ran += 1
    return ran


def test_the_tutorial_runs_as_written(tmp_path: Path) -> None:
    project = tmp_path / "tutorial"
    project.mkdir()
    assert run_as_written(TUTORIAL, project) >= 8
    # the console script from another directory finds the module beside the config: the build is up to date
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    again = run(
        f"flashrt-build --config-dir {project / 'my_conf'} +module=small_cnn weights=external "
        f"output_root={project / 'outputs'}",
        elsewhere,
    )
    assert again.returncode == 0, again.stdout[-3000:]
    assert "up to date" in again.stdout and "nothing to do" in again.stdout


def test_the_llm_guide_runs_as_written(tmp_path: Path) -> None:
    """The example Llama built, verified, and telling its story: the text the
    README shows is the text generate printed (greedy tokens of a model
    trained to them, so any machine prints them)."""
    project = tmp_path / "llm"
    project.mkdir()
    assert run_as_written(LLM_GUIDE, project) >= 5
