"""One log line per stage with its duration; a live timer on a terminal."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Iterator

log = logging.getLogger("flashrt_build")


class StageTimer:
    """Times the pipeline's stages; `timings` goes into the manifest."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.timings: dict[str, float] = {}
        self.notes: dict[str, str] = {}

    @contextlib.contextmanager
    def stage(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        stop = threading.Event()
        ticker = None
        if sys.stderr.isatty():
            ticker = threading.Thread(target=_tick, args=(f"{self.name}: {stage}", start, stop), daemon=True)
            ticker.start()
        try:
            yield
        finally:
            stop.set()
            if ticker is not None:
                ticker.join()
            elapsed = time.perf_counter() - start
            self.timings[stage] = round(elapsed, 3)
        note = self.notes.get(stage)
        log.info("%-11s %7.2fs%s", stage, elapsed, f"  {note}" if note else "")


def _tick(label: str, start: float, stop: threading.Event) -> None:
    frames = "|/-\\"
    i = 0
    while not stop.wait(0.25):
        sys.stderr.write(f"\r{frames[i % 4]} {label} {time.perf_counter() - start:6.1f}s")
        sys.stderr.flush()
        i += 1
    if i:
        sys.stderr.write("\r\033[K")
        sys.stderr.flush()
