"""A test script in a fresh Python process: the only way to run the
package's Triton kernels on a CPU, under Triton's interpreter, which
TRITON_INTERPRET turns on only before triton is first imported."""

from __future__ import annotations

import os
import subprocess
import sys


def in_fresh_process(script: str, device: str = "cpu") -> None:
    """Run `script`, which prints "ok" last once its assertions hold: on a
    CPU in Triton's interpreter, on a GPU compiled; fail with its stderr."""
    env = {**os.environ, "TRITON_INTERPRET": "1"} if device == "cpu" else dict(os.environ)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
