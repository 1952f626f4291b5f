"""Device memory that loading a package of two methods adds, against one copy
of its weights: a llama-sized tiny_lm (prefill + decode over a static KV
cache, external weights) on the GPU.

    CXX=g++-12 python bench/gpu_methods.py            # H200: dim 2048, 22 layers, 32k vocab (1.2B parameters)
    python bench/gpu_methods.py --target cpu --size dim=128,layers=2,vocab=1000,max_len=64   # a smoke run

Builds through the CLI (verification off: this measures loading, and the
CPU-side verification of both methods is covered by the tests), then, in
this process: loads the package reading its sidecar (the weights must be
there once, not once per method) and bound to the eager module's own tensors
(nothing added), and runs prefill then a decode step on each to show the
methods work off the one copy.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from report import RESULTS, cli_build, memory_used, publish, table  # noqa: E402

import flashrt_build  # noqa: E402
from flashrt_build.config.compose import compose  # noqa: E402
from flashrt_build.config.spec import resolve_spec  # noqa: E402
from flashrt_build.stages.module import instantiate_module  # noqa: E402

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="cuda")
    parser.add_argument("--size", default="dim=2048,heads=32,layers=22,vocab=32000,max_len=512")
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu_methods.md")
    args = parser.parse_args()
    overrides = ["+module=tiny_lm", f"target={args.target}", "weights=external", "verify.enabled=false"]
    overrides += [f"module.model.{pair}" for pair in args.size.split(",")]
    overrides += ["module.methods.prefill.inputs.input_ids.dynamic={1: {name: prompt, min: 2, max: 256}}"]
    overrides += [
        "module.methods.prefill.inputs.input_ids.high=1000",
        "module.methods.decode.inputs.input_ids.high=1000",
    ]
    with tempfile.TemporaryDirectory() as root:
        out, manifest, build_s = cli_build(overrides, root)
        weights = sum(math.prod(t["shape"]) * ITEMSIZE[t["dtype"]] for t in manifest["weights"]["tensors"])
        rows = []
        length = manifest["methods"]["prefill"]["inputs"][0]["shape"][1]  # the example prompt
        prompt = torch.randint(0, 1000, (1, length), device=manifest["target"]["device"])
        token, position = prompt[:, :1], torch.tensor([length], device=prompt.device)
        for how in ("sidecar", "eager's tensors"):
            host = instantiate_module(resolve_spec(compose(overrides))) if how != "sidecar" else None
            before = memory_used(args.target)
            began = time.perf_counter()
            model = flashrt_build.load(out, host=host)
            seconds = time.perf_counter() - began
            added = memory_used(args.target) - before
            with torch.no_grad():
                model.prefill(prompt)
                logits = model.decode(token, position)
            rows.append([how, f"{seconds:.2f}", f"{added / 2**20:.0f}", f"{added / weights:.3f}", list(logits.shape)])
            del model, host
    text = f"{manifest['name']} `{args.size}` on {manifest['target']['device']} ({manifest['target']['dtype']}): "
    text += f"{weights / 2**20:.0f} MB of weights, {len(manifest['weights']['tensors'])} tensors, "
    text += f"package {manifest['package']['bytes'] / 1e6:.1f} MB, built in {build_s:.0f} s "
    compiles = ", ".join(f"{k} {v:.0f} s" for k, v in manifest["timings"].items() if k.startswith("compile"))
    text += f"({compiles})\n\n"
    text += table(["load, weights from", "load s", "MB added", "added / one copy", "decode logits"], rows, "lrrrl")
    command = "CXX=g++-12 python bench/gpu_methods.py" + (
        f" --target {args.target} --size {args.size}" if args.target != "cuda" else ""
    )
    publish(args.out, "Loading one package of two methods: memory against one copy of the weights", command, text)


if __name__ == "__main__":
    main()
