"""External weights: package size against baked, and a checkpoint swap against a full build.

    .venv/bin/python bench/external_weights.py [--modules mlp gpt2_tiny] [--out bench/results/external_weights.md]

Each build runs through the real CLI in a fresh process and a fresh output
root, so a "full build" compiles and a "swap" is the same config with only
module.checkpoint changed (the package store makes it skip the compile).
Times are wall-clock for the whole command, Python start-up included.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from report import RESULTS, publish, table  # noqa: E402

from flashrt_build.config.compose import compose  # noqa: E402
from flashrt_build.config.spec import resolve_spec  # noqa: E402
from flashrt_build.stages.module import instantiate_module  # noqa: E402


def cli_build(root: Path, *overrides: str) -> tuple[float, dict]:
    out = root / f"b{len(list(root.iterdir()))}"
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "flashrt_build", *overrides, f"output_dir={out}", f"output_root={root}"],
        check=True,
        capture_output=True,
    )
    return time.perf_counter() - start, json.loads((out / "manifest.json").read_text())


def other_checkpoint(module: str, path: Path) -> Path:
    """The module's weights from another seed, as a torch state dict (tied
    weights included, which safetensors would refuse to save twice)."""
    model = instantiate_module(resolve_spec(compose([f"+module={module}", "seed=99"])))
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--modules", nargs="+", default=["mlp", "gpt2_tiny"])
    parser.add_argument("--out", type=Path, default=RESULTS / "external_weights.md")
    args = parser.parse_args()
    rows = []
    for module in args.modules:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp) / "root"
            root.mkdir()
            ckpt = other_checkpoint(module, Path(tmp) / "other.pt")
            _, baked = cli_build(root, f"+module={module}", "weights=baked")
            full_s, external = cli_build(root, f"+module={module}", "weights=external")
            swap_s, swapped = cli_build(root, f"+module={module}", "weights=external", f"module.checkpoint={ckpt}")
            assert swapped["package"]["reused"] and swapped["package"]["sha256"] == external["package"]["sha256"]
            rows.append(
                {
                    "module": module,
                    "baked_mb": baked["package"]["bytes"] / 1e6,
                    "external_mb": external["package"]["bytes"] / 1e6,
                    "sidecar_mb": external["weights"]["bytes"] / 1e6,
                    "size_ratio": external["package"]["bytes"] / baked["package"]["bytes"],
                    "full_s": full_s,
                    "full_compile_s": external["timings"]["compile"],
                    "swap_s": swap_s,
                    "swap_ratio": swap_s / full_s,
                }
            )
    header = ["module", "baked pkg MB", "external pkg MB", "sidecar MB", "external/baked"]
    header += ["full external build s (compile s)", "checkpoint swap s", "swap/full"]
    cells = [
        [
            r["module"],
            f"{r['baked_mb']:.2f}",
            f"{r['external_mb']:.2f}",
            f"{r['sidecar_mb']:.2f}",
            f"{r['size_ratio']:.3f}",
            f"{r['full_s']:.1f} ({r['full_compile_s']:.1f})",
            f"{r['swap_s']:.1f}",
            f"{r['swap_ratio']:.2f}",
        ]  # fmt: skip
        for r in rows
    ]
    machine = f"torch {torch.__version__}, {sys.platform}, {os.cpu_count()} cores"
    publish(
        args.out,
        "External weights",
        ".venv/bin/python bench/external_weights.py",
        f"{machine}\n\n{table(header, cells)}",
    )


if __name__ == "__main__":
    main()
