"""Quantized packages against the unquantized one: tiny_lm built once per
`quant` recipe (external weights, verification on: its error against the
float module recorded), then, in one process with the variants alternating,
a decode step and a prefill replayed from CUDA graphs. Reports per recipe:
weight bytes, decode and prefill times, each as a ratio against `--baseline`
(quant=none), compile times, and the error and top-1 agreement against the
float module.

    CXX=g++-12 python bench/quant_llm.py                       # H200: tiny_lm at 1.2B, bf16
    CXX=g++-12 python bench/quant_llm.py --recipes int8_wo --inductor decode
    python bench/quant_llm.py --target cpu --size dim=64,heads=4,layers=2,vocab=256,max_len=64 \\
        --recipes int8_wo --prompt 16 --steps 5 --rounds 2       # a smoke run

Timing as bench/serve_llm.py: steps back to back timed with CUDA events,
`--steps` per sample; a figure is the median sample, a ratio the median of
per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from report import RESULTS, BuildFailed, build_root, cli_build, publish, table  # noqa: E402
from serve_llm import ratio, timed  # noqa: E402

import flashrt_build  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="cuda")
    parser.add_argument("--size", default="dim=2048,heads=32,layers=22,vocab=32000,max_len=1024")
    parser.add_argument("--recipes", default="int8_wo,fp8,int4_wo", help="conf/quant/ recipes, comma-separated")
    parser.add_argument("--baseline", default="none", help="the recipe the others are compared with")
    parser.add_argument("--inductor", default="default", help="the Inductor profile of every build")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=50, help="steps per timed sample")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL=RECIPE[,OVERRIDE...]",
        help="also build RECIPE with these overrides, under LABEL (e.g. int8_pm=int8_wo,quant.inductor.methods={})",
    )
    parser.add_argument("--out-name", default="quant_llm")
    parser.add_argument("--work", help="build here and keep the builds (a rerun reuses them); default: a temp dir")
    args = parser.parse_args()
    size = dict(pair.split("=") for pair in args.size.split(","))
    overrides = ["+module=tiny_lm", f"target={args.target}", "weights=external", f"inductor={args.inductor}"]
    overrides += [f"module.model.{key}={value}" for key, value in size.items()]
    overrides += [
        f"module.methods.prefill.inputs.input_ids.dynamic={{1: {{name: prompt, min: 2, max: {args.prompt}}}}}",
        f"module.methods.prefill.inputs.input_ids.high={size['vocab']}",
        f"module.methods.decode.inputs.input_ids.high={size['vocab']}",
        f"module.methods.decode.inputs.position.high={size['max_len']}",
    ]
    recipes = [args.baseline, *(r for r in args.recipes.split(",") if r and r != args.baseline)]
    builds = {recipe: [f"quant={recipe}"] for recipe in recipes}
    for variant in args.variant:
        label, _, spec = variant.partition("=")
        recipe, *extra = spec.split(",")
        builds[label] = [f"quant={recipe}", *extra]
    device = torch.device(args.target)
    results: dict[str, Any] = {"recipes": {}, "failed": {}}
    with build_root(args.work) as root:
        built = {}
        for recipe, own in builds.items():
            try:
                out, manifest, seconds = cli_build([*overrides, *own, f"output_dir={root}/{recipe}"], root)
            except BuildFailed as failed:
                if recipe == args.baseline:
                    raise
                # The others are still measured: a failing recipe costs no rerun of them.
                results["failed"][recipe] = {"error": failed.error, "overrides": own}
                continue
            built[recipe] = out
            results["recipes"][recipe] = {**summary(manifest, seconds), "overrides": own}
        loaded = {recipe: flashrt_build.load(out, cuda_graphs=device.type == "cuda") for recipe, out in built.items()}
        prompt = torch.randint(0, int(size["vocab"]), (1, args.prompt), generator=torch.Generator().manual_seed(0))
        prompt = prompt.to(device)
        token, position = prompt[:, :1].clone(), torch.tensor([args.prompt], device=device)
        with torch.no_grad():
            decode = {r: (lambda lm=lm: lm.decode.run_trusted(token, position)) for r, lm in loaded.items()}
            prefill = {r: (lambda lm=lm: lm.prefill(prompt)) for r, lm in loaded.items()}
            results["decode_ms"] = timed(decode, args, device)
            results["prefill_ms"] = timed(prefill, args, device, steps=max(2, args.steps // 5))
    for recipe, entry in results["recipes"].items():
        base = results["recipes"][args.baseline]
        entry["weight_bytes_ratio"] = entry["weight_bytes"] / base["weight_bytes"]
        entry["decode_ratio"] = ratio(results, "decode_ms", recipe, args.baseline)
        entry["prefill_ratio"] = ratio(results, "prefill_ms", recipe, args.baseline)
    (RESULTS / f"{args.out_name}.json").write_text(json.dumps(results, indent=2))
    command = (
        f"CXX=g++-12 python bench/quant_llm.py --recipes {args.recipes}"
        + (f" --inductor {args.inductor}" if args.inductor != "default" else "")
        + (f" --size {args.size}" if args.size != parser.get_default("size") else "")
        + "".join(f" --variant {shlex.quote(v)}" for v in args.variant)
        + (f" --out-name {args.out_name}" if args.out_name != parser.get_default("out_name") else "")
    )
    publish(RESULTS / f"{args.out_name}.md", "Quantized packages against bf16", command, report(results, args))


def summary(manifest: dict[str, Any], seconds: float) -> dict[str, Any]:
    """What a recipe's build says of itself: bytes, compile times, error against the float module."""
    weight_bytes = sum(
        math.prod(t["shape"]) * torch.empty(0, dtype=getattr(torch, t["dtype"])).element_size()
        for t in manifest["weights"]["tensors"]
    )
    quantization = manifest["verification"].get("quantization") or {}
    return {
        "weight_bytes": weight_bytes,
        "build_s": seconds,
        "compile_s": {k: v for k, v in manifest["timings"].items() if k.startswith("compile")},
        "inductor_options": {name: m["inductor_options"] for name, m in manifest["methods"].items()},
        "max_rel_err_vs_float": quantization.get("max_rel_err"),
        "top1_agreement": quantization.get("top1_agreement"),
    }


def report(results: dict[str, Any], args: argparse.Namespace) -> str:
    text = (
        f"tiny_lm `{args.size}` on {args.target}, external weights, inductor={args.inductor}, torch "
        f"{torch.__version__}; against quant={args.baseline}. Decode: one token at position {args.prompt}, replayed "
        f"from a CUDA graph on a GPU; prefill: {args.prompt} tokens.\n\n"
    )
    rows = []
    for recipe, e in results["recipes"].items():
        compiles = ", ".join(f"{k.removeprefix('compile ')} {s:.0f} s" for k, s in e["compile_s"].items())
        error = "-" if e["max_rel_err_vs_float"] is None else f"{e['max_rel_err_vs_float']:.4f}"
        agreement = "-" if e["top1_agreement"] is None else f"{e['top1_agreement']:.3f}"
        rows.append([
            recipe, f"{e['weight_bytes'] / 1e6:.0f} MB", f"{e['weight_bytes_ratio']:.3f}",
            f"{results['decode_ms'][recipe]['median']:.3f}", f"{e['decode_ratio']:.3f}",
            f"{results['prefill_ms'][recipe]['median']:.3f}", f"{e['prefill_ratio']:.3f}",
            compiles or "reused", error, agreement,
        ])  # fmt: skip
    header = ["recipe", "weights", "x", "decode ms", "x", "prefill ms", "x", "compile", "rel err vs float", "top-1"]
    failed = "".join(f"\n- `{recipe}` did not build: {f['error']}" for recipe, f in results["failed"].items())
    return text + table(header, rows, "llrrrrrlrr") + (f"\nFailed builds:\n{failed}\n" if failed else "")


if __name__ == "__main__":
    main()
