"""The process that runs one build of a sweep.

    python -m flashrt_build.sweep.build_process JOB_DIR

Builds JOB_DIR/build_config.yaml and writes JOB_DIR/build_result.json; logs
go to stderr as LEVEL|message for `flashrt_build.sweep.job` to relay.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ..errors import Interrupted, exit_interrupted, quiet_known_warnings, report_failure, stop_on_signals
from .job import BUILD_CONFIG, BUILD_RESULT, failure

log = logging.getLogger("flashrt_build")


def main(job_dir: Path) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s|%(message)s", stream=sys.stdout)
    quiet_known_warnings()
    stop_on_signals()  # a cancelled job cleans up its staging directory
    cfg = OmegaConf.load(job_dir / BUILD_CONFIG)
    assert isinstance(cfg, DictConfig)  # the job's build config, as the launcher wrote it
    outcome: dict[str, Any]
    try:
        from ..pipeline import build

        outcome = {"status": build(cfg).status}
    except Exception as exc:  # raised on purpose or not: this job's failure, in one line
        outcome = failure(report_failure(log, exc))
    (job_dir / BUILD_RESULT).write_text(json.dumps(outcome) + "\n")
    return int(outcome.get("exit_code", 0))


if __name__ == "__main__":
    job_dir = Path(sys.argv[1])
    try:
        sys.exit(main(job_dir))
    except Interrupted as stopped:  # the sweep's summary says "Interrupted", not that the process died
        (job_dir / BUILD_RESULT).write_text(json.dumps(failure(stopped)) + "\n")
        exit_interrupted(stopped, log.error)
