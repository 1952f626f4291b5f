"""Tests against a real one-node SLURM cluster (slurmctld, slurmd, slurmdbd,
munge from the distribution), brought up and down by `cluster.sh`:

    make test-slurm     (tests/slurm/cluster.sh run .venv/bin/python -m pytest -q tests/slurm)

They are collected only where cluster.sh exported FLASHRT_SLURM_PARTITION, so
`make test` never runs them; every test here is marked `slurm` and `slow`
(each builds packages in SLURM jobs).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
PARTITION_ENV = "FLASHRT_SLURM_PARTITION"

if not os.environ.get(PARTITION_ENV):
    collect_ignore_glob = ["test_*.py"]  # no cluster: make test-slurm brings one up

# slurm_modules.py must import in the jobs' build processes (sbatch exports this environment).
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slurm: runs SLURM jobs on the cluster tests/slurm/cluster.sh brings up")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # noqa: ANN201 - a hook wrapper
    """A failed test's report ends with the daemons' logs."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and item.get_closest_marker("slurm"):
        logs = subprocess.run([str(HERE / "cluster.sh"), "logs"], capture_output=True, text=True, timeout=60).stdout
        report.sections.append(("SLURM daemons' logs", logs[-20000:]))
