"""Builds from a large sharded checkpoint: peak memory, and the cost of an
up-to-date check over its shards.

    .venv/bin/python bench/trained_checkpoint.py [--gb 2] [--rounds 5] [--root DIR]

Writes a checkpoint of `--gb` GB as `save_pretrained` would (safetensors
shards of at most 512 MB and their index) for a stack of square layers,
then:

- builds it (`module.checkpoint=DIR`), baked and external, each in a fresh
  process that reports its own peak resident set (`ru_maxrss`, the build
  process alone; the verification process, which loads the package, is
  reported beside it), against the checkpoint's size (goal <= 1.5x);
- times no-op rebuilds through the command line, alternating in rounds: the
  default mlp (no checkpoint), the big build with its digests remembered, and
  the big build with `.store/digests.json` removed first, so every shard and
  artifact file is read again (goal: remembered <= 1.5x the mlp's).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from report import RESULTS, alternate, publish, table

HERE = Path(__file__).resolve().parent
LAYERS = 8


class Stack(torch.nn.Module):
    """`LAYERS` square layers: weight tensors of 256 MB at 2 GB, two per shard."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def write_checkpoint(directory: Path, gb: float) -> tuple[int, int]:
    """A Stack's state dict of about `gb` GB, sharded like save_pretrained; (width, bytes)."""
    from huggingface_hub import save_torch_state_dict

    width = int(math.sqrt(gb * 2**30 / (4 * LAYERS)))
    width -= width % 64
    torch.manual_seed(0)
    with torch.no_grad():
        state = Stack(width).state_dict()
    directory.mkdir(parents=True)
    save_torch_state_dict(state, str(directory), max_shard_size="512MB")
    return width, sum(p.stat().st_size for p in directory.glob("*.safetensors"))


def overrides(width: int, checkpoint: Path, root: Path, weights: str) -> list[str]:
    return [
        "+module=stack",
        f"module.model.width={width}",
        f"module.inputs.x.shape=[4,{width}]",
        f"module.checkpoint={checkpoint}",
        f"weights={weights}",
        f"output_root={root}",
        f"output_dir={root / weights}",
        "verify.repeat=0",
    ]


def config_dir(root: Path) -> Path:
    """A module config for Stack (this file, importable as `trained_checkpoint`)."""
    (root / "conf" / "module").mkdir(parents=True)
    (root / "conf" / "module" / "stack.yaml").write_text(
        "name: stack\nmodel: {_target_: trained_checkpoint.Stack, width: 64}\n"
        "inputs: {x: {shape: [4, 64], dynamic: {0: {name: batch, min: 1, max: 16}}}}\n"
    )
    return root / "conf"


def child_build(args: list[str]) -> None:
    """In a fresh process: one build through the API, then this process's peak
    RSS (not the verification process's, which loads the package on its own)."""
    import flashrt_build
    from flashrt_build.config.compose import compose

    start = time.perf_counter()
    conf, overrides = Path(args[0]), args[1:]
    result = flashrt_build.build(compose(overrides, config_dir=conf))
    print(
        json.dumps(
            {
                "status": result.status,
                "wall_s": time.perf_counter() - start,
                "timings": result.manifest["timings"],
                "maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            }
        )
    )


def cli_wall(command: list[str], before: Path | None = None) -> float:
    if before is not None:
        before.unlink(missing_ok=True)  # forget every remembered digest
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(HERE)})
    elapsed = time.perf_counter() - start
    if done.returncode != 0 or "nothing to do" not in done.stderr:
        raise SystemExit(f"expected a no-op: {' '.join(command)}\n{done.stderr[-2000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gb", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=5, help="no-op rounds (0: memory only)")
    parser.add_argument("--modes", default="external,baked", help="weights modes whose builds are measured")
    parser.add_argument(
        "--root", type=Path, default=None, help="where the checkpoint and builds go (default: a temp dir)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "trained_checkpoint.md")
    parser.add_argument("--child-build", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_build is not None:
        child_build(args.child_build)
        return
    with tempfile.TemporaryDirectory(dir=args.root) as tmp:
        root = Path(tmp)
        checkpoint = root / "checkpoint"
        width, size = write_checkpoint(checkpoint, args.gb)
        conf = config_dir(root)
        shards = len(list(checkpoint.glob("*.safetensors")))
        print(f"checkpoint: {size / 2**30:.2f} GiB in {shards} shards, width {width}", flush=True)

        memory_rows = []
        for weights in args.modes.split(","):
            command = [
                sys.executable,
                __file__,
                "--child-build",
                str(conf),
                *overrides(width, checkpoint, root / "out", weights),
            ]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(done.stderr[-3000:])
            built = json.loads(done.stdout.strip().splitlines()[-1])
            ratio = built["maxrss_bytes"] / size
            memory_rows.append(
                [
                    weights,
                    f"{size / 2**30:.2f}",
                    f"{built['maxrss_bytes'] / 2**30:.2f}",
                    f"**{ratio:.2f}x**",
                    f"{built['wall_s']:.0f}",
                    ", ".join(f"{k} {v:.0f}" for k, v in built["timings"].items() if v >= 1),
                ]
            )
            print(memory_rows[-1], flush=True)
        if not args.rounds:
            return

        cli = [sys.executable, "-m", "flashrt_build"]
        mlp = [*cli, "+module=mlp", f"output_root={root / 'mlp'}"]
        subprocess.run(mlp, check=True, capture_output=True)  # the build the mlp no-ops find in place
        big = [*cli, "--config-dir", str(conf), *overrides(width, checkpoint, root / "out", "external")]
        digests = root / "out" / ".store" / "digests.json"
        cli_wall(big)  # remembers every digest older than a second
        variants = {
            "mlp (no checkpoint)": lambda: cli_wall(mlp),
            f"{args.gb:g} GB checkpoint, digests remembered": lambda: cli_wall(big),
            f"{args.gb:g} GB checkpoint, digests cold": lambda: cli_wall(big, before=digests),
        }
        times = alternate(variants, args.rounds)
    med = {name: statistics.median(t) for name, t in times.items()}
    base = med["mlp (no checkpoint)"]
    noop_rows = [
        [name, f"{med[name]:.2f}", f"{min(t):.2f}", f"{max(t):.2f}", f"**{med[name] / base:.2f}x**"]
        for name, t in times.items()
    ]
    text = (
        f"Checkpoint: {size / 2**30:.2f} GiB in {shards} safetensors shards (max 512 MB) with their index, "
        f"{LAYERS} square layers of width {width}; 2-core CPU.\n\n"
        "Peak resident memory of the build process (`ru_maxrss`; the verification process loads the package "
        "on its own), torch's own import included; goal: at most 1.5x the checkpoint.\n\n"
        + table(
            ["weights", "checkpoint GiB", "build peak RSS GiB", "peak / checkpoint", "build wall s", "stages >= 1 s"],
            memory_rows,
        )  # fmt: skip
        + f"\nNo-op rebuilds through the command line, {args.rounds} alternating rounds (cold: "
        "`.store/digests.json` removed first, so the shards and the 2 GiB sidecar are hashed again); goal: "
        "remembered at most 1.5x the mlp's.\n\n"
        + table(["no-op", "median wall s", "min", "max", "/ mlp no-op"], noop_rows)
    )
    publish(
        args.out,
        "Builds from a large sharded checkpoint",
        f".venv/bin/python bench/trained_checkpoint.py --gb {args.gb:g} --rounds {args.rounds}",
        text,
    )


if __name__ == "__main__":
    main()
