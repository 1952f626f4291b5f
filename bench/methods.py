"""One package of several methods against the same methods as separate
packages: weights on disk and in memory, and build time.

    .venv/bin/python bench/methods.py [--rounds 2] [--size dim=512,layers=8,vocab=8192,max_len=256]

Builds tiny_lm (prefill + decode, external weights), scaled up so the
weights dominate, three ways through the CLI, each into a fresh output root
with verification: both methods as one package, prefill alone, decode alone.
The builds alternate over `--rounds`. Then, in a fresh process per load,
alternating, it measures the resident memory that loading adds: the one
package, against both separate packages loaded side by side (what serving
the two methods from two packages takes). Goals: the one package's sidecar
and memory count the weights once (<= 1.05x one copy); its build is no
slower than the two separate builds together.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from report import RESULTS, alternate, publish, table

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
VARIANTS = {
    "one package, two methods": [],
    "prefill alone": ["~module.methods.decode"],
    "decode alone": ["~module.methods.prefill"],
}
# In a fresh process: what loading imports (torch, Inductor's package loader)
# imported first, then the packages loaded, each method called once and every
# bound tensor read (a mapped sidecar's pages count once read); prints the
# resident bytes added.
LOAD = """
import json, sys, torch, flashrt_build
import flashrt_build.runtime.load, safetensors.torch, torch._inductor.package  # what loading imports
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) * 1024
given = sys.argv[1] == "given"  # the weights in memory before: what loading adds besides them
dirs = sys.argv[2:]
# safetensors maps the file: clone, so given weights are resident before the baseline
read = [safetensors.torch.load_file(d + "/weights.safetensors") for d in dirs] if given else [None] * len(dirs)
weights = [{k: t.clone() for k, t in w.items()} if w else None for w in read]
before = rss()
models = [flashrt_build.load(d, weights=w) for d, w in zip(dirs, weights)]
with torch.no_grad():
    for model in models:
        for name, method in model.methods.items():
            entry = model.manifest["methods"][name]
            method(**{i["name"]: torch.zeros(i["shape"], dtype=getattr(torch, i["dtype"])) for i in entry["inputs"]})
        # a mapped sidecar is resident only where read: read every bound tensor, as serving eventually does
        sum(float(t.float().sum()) for t in model.bound_weights.values())
print(rss() - before)
"""


def build(root: Path, size: list[str], extra: list[str]) -> tuple[float, Path]:
    command = [sys.executable, "-m", "flashrt_build", "+module=tiny_lm", "weights=external", f"output_root={root}"]
    start = time.perf_counter()
    done = subprocess.run([*command, *size, *extra], capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    seconds = time.perf_counter() - start
    return seconds, next(p.parent for p in root.rglob("manifest.json") if ".store" not in p.parts)


def resident(directories: list[Path], given: bool = False) -> int:
    how = "given" if given else "read"
    done = subprocess.run([sys.executable, "-c", LOAD, how, *map(str, directories)], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    return int(done.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--size", default="dim=512,layers=8,vocab=8192,max_len=256")
    parser.add_argument("--out", type=Path, default=RESULTS / "methods.md")
    args = parser.parse_args()
    size = [f"module.model.{pair}" for pair in args.size.split(",")]
    with tempfile.TemporaryDirectory() as scratch:
        dirs: dict[str, Path] = {}

        def timed(name: str) -> float:
            seconds, dirs[name] = build(Path(tempfile.mkdtemp(dir=scratch)), size, VARIANTS[name])
            return seconds

        walls = alternate({name: lambda name=name: timed(name) for name in VARIANTS}, args.rounds)
        one, apart = [dirs["one package, two methods"]], [dirs["prefill alone"], dirs["decode alone"]]
        memory = alternate(
            {
                "one package": lambda: resident(one),
                "one package, weights given": lambda: resident(one, given=True),
                "two packages": lambda: resident(apart),
            },
            3,
        )
        manifest = json.loads((one[0] / "manifest.json").read_text())
        weights = sum(math.prod(t["shape"]) * ITEMSIZE[t["dtype"]] for t in manifest["weights"]["tensors"])
        sidecars = {name: (d / "weights.safetensors").stat().st_size for name, d in dirs.items()}
        stages = {name: json.loads((d / "manifest.json").read_text())["timings"] for name, d in dirs.items()}
    build_s = {name: statistics.median(w) for name, w in walls.items()}
    rows = [
        [name, f"{build_s[name]:.1f}", ", ".join(f"{w:.1f}" for w in walls[name]), f"{sidecars[name] / 1e6:.1f}"]
        for name in VARIANTS
    ]
    text = f"Weights: {weights / 1e6:.1f} MB (float32), tiny_lm with `{args.size}`.\n\n"
    text += table(["package", "build s, median", "rounds", "sidecar MB"], rows, "lrlr")
    separate_s = build_s["prefill alone"] + build_s["decode alone"]
    separate_mb = sidecars["prefill alone"] + sidecars["decode alone"]
    rss = {name: statistics.median(m) / 1e6 for name, m in memory.items()}
    overhead = rss["one package, weights given"]
    weights_mb, second_copy = rss["one package"] - overhead, rss["two packages"] - rss["one package"]
    ratios = [
        [
            "sidecar bytes: one package / one copy of the weights",
            f"{sidecars['one package, two methods'] / weights:.3f}",
        ],
        ["sidecar bytes: two packages / one copy", f"{separate_mb / weights:.3f}"],
        ["resident MB added by loading (and calling each method): one package", f"{rss['one package']:.1f}"],
        ["... the same with its weights already in memory: code, runtime, activations", f"{overhead:.1f}"],
        ["... two packages", f"{rss['two packages']:.1f}"],
        ["weights in memory, one package (added minus the above) / one copy", f"{weights_mb / (weights / 1e6):.3f}"],
        ["two packages minus one package / one copy (the second copy)", f"{second_copy / (weights / 1e6):.3f}"],
        ["build time: one package / both separate builds", f"{build_s['one package, two methods'] / separate_s:.3f}"],
    ]
    text += "\n" + table(["measure", "value"], ratios, "lr")
    stage_rows = [[name, ", ".join(f"{k} {v:.1f}" for k, v in timings.items())] for name, timings in stages.items()]
    text += "\nStages of the last build of each (s):\n\n" + table(["package", "stages"], stage_rows)
    publish(
        args.out,
        "One package of two methods vs two packages",
        f".venv/bin/python bench/methods.py --rounds {args.rounds}",
        text,
    )


if __name__ == "__main__":
    main()
