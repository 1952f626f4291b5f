"""One log line per stage with its duration; a live timer on a terminal."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

log = logging.getLogger("flashrt_build")


T = TypeVar("T")


@dataclass
class Stage(Generic[T]):
    """What a stage returns: its value for the next stage, the manifest
    sections it fills, and its one-line note for the log."""

    value: T
    note: str = ""
    sections: dict[str, Any] = field(default_factory=dict)


class StageTimer:
    """Runs and times the pipeline's stages, logs a line for each, and keeps
    the manifest sections they return; `timings` goes into the manifest."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.timings: dict[str, float] = {}
        self.notes: dict[str, str] = {}
        self.sections: dict[str, Any] = {}

    def run(self, stage: str, function: Callable[..., Stage[T]], *args: Any) -> T:
        """`function(*args)` as the stage named `stage`: its value, its sections kept."""
        with self.stage(stage):
            done = function(*args)
            self.notes[stage] = done.note
        self.sections.update(done.sections)
        return done.value

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
