"""Real models through flashrt_build against eager, torch.compile and the raw
AOTInductor API, side by side in one process.

    CXX=g++-12 python bench/gpu_models.py --module bert_base --profiles default,max_autotune
    CXX=g++-12 python bench/gpu_models.py --module resnet50 --profiles default,max_autotune --jobs 2
    CXX=g++-12 python bench/gpu_models.py --module llama_1b --weights external --profiles default,max_autotune --jobs 2
    python bench/gpu_models.py --module bert_tiny --target cpu --rounds 2   # a smoke run without a GPU

1. Builds the flashrt_build packages (every profile x weights mode) with the
   real CLI as one parallel sweep, verification included, while this process
   exports the same seeded module with `torch.export.export` and compiles it
   with `aoti_compile_and_package` (the raw API, default options), baked and,
   when external weights are built, without its weights
   (`package_constants_in_so=False`, bound with `load_constants`).
2. Loads every variant: the eager module, `torch.compile` (default mode), the
   raw packages (`aoti_load_package`), and each flashrt_build package through
   `flashrt_build.load` (external ones twice: reading the sidecar, and bound to
   the eager module's own tensors). Load time, device memory added, and for
   external packages the time to read the sidecar alone.
3. Times them alternately: `--rounds` rounds, each variant `--iters` calls
   after warm-up, the order rotated every round. Median per call, the spread
   of the round medians, p10/p90 of all calls.
4. Writes JSON and a markdown table with the issue's goals checked.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from report import memory_used, table  # noqa: E402

import flashrt_build  # noqa: E402
from flashrt_build.config.compose import compose  # noqa: E402
from flashrt_build.config.spec import resolve_spec  # noqa: E402
from flashrt_build.stages.inputs import make_inputs  # noqa: E402
from flashrt_build.stages.module import instantiate_module  # noqa: E402


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def start_builds(args: argparse.Namespace, root: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "flashrt_build", "-m", f"+module={args.module}", f"target={args.target}"]
    command += [f"weights={args.weights}", f"inductor={args.profiles}", f"output_root={root / 'out'}"]
    command += [f"hydra.sweep.dir={root / 'sweep'}", "hydra/launcher=parallel", f"hydra.launcher.n_jobs={args.jobs}"]
    log = open(root / "builds.log", "w")  # noqa: SIM115 - closed with the process
    print("building:", " ".join(command[2:]), flush=True)
    env = {**os.environ, "FLASHRT_BUILDS_PER_GPU": str(args.jobs)}  # builds share the GPU: compiling is CPU work
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def raw_aoti(module: torch.nn.Module, example: Any, root: Path, external: bool) -> tuple[Path, dict[str, float]]:
    """The raw path a user would write: export, compile and package with
    defaults; `external`: the package without its weights."""
    start = time.perf_counter()
    program = torch.export.export(module, example.args, example.kwargs, strict=False)
    exported = time.perf_counter()
    options = {"aot_inductor.package_constants_in_so": False} if external else {}
    path = root / ("raw_external.pt2" if external else "raw.pt2")
    torch._inductor.aoti_compile_and_package(program, package_path=str(path), inductor_configs=options)
    return path, {"export": exported - start, "compile": time.perf_counter() - exported}


def load_raw_external(path: Path, module: torch.nn.Module) -> Any:
    """The raw API's zero-copy binding: the module's own tensors, user-managed."""
    runner = torch._inductor.aoti_load_package(str(path))
    named = dict(module.named_parameters(remove_duplicate=False)) | dict(module.named_buffers(remove_duplicate=False))
    runner.load_constants(
        {fqn: named[fqn] for fqn in runner.get_constant_fqns()}, check_full_update=True, user_managed=True
    )
    return runner


def timed_read(device: str, path: Path) -> float:
    """Seconds to read a safetensors sidecar onto the device, alone."""
    start = time.perf_counter()
    tensors = safetensors.torch.load_file(str(path), device=device)
    sync(device)
    seconds = time.perf_counter() - start
    del tensors
    return seconds


def timed_load(device: str, load: Any) -> tuple[Any, float, int]:
    before = memory_used(device) if device.startswith("cuda") else 0
    start = time.perf_counter()
    runner = load()
    sync(device)
    seconds = time.perf_counter() - start
    return runner, seconds, (memory_used(device) - before) if device.startswith("cuda") else 0


def time_calls(fn: Any, device: str, iters: int, warmup: int) -> list[float]:
    """Milliseconds per call, each call timed alone."""
    with torch.no_grad():
        for _ in range(warmup):
            fn()
        sync(device)
        times = []
        for _ in range(iters):
            if device.startswith("cuda"):
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                fn()
                end.record()
                end.synchronize()
                times.append(begin.elapsed_time(end))
            else:
                start = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start) * 1e3)
    return times


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--module", required=True)
    parser.add_argument("--target", default="cuda")
    parser.add_argument("--profiles", default="default", help="comma list of conf/inductor profiles")
    parser.add_argument("--weights", default="baked,external")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--jobs", type=int, default=3, help="flashrt_build builds at once")
    parser.add_argument("--root", type=Path, default=Path("/tmp/flashrt-bench"))
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()

    began = time.perf_counter()
    root = args.root / args.module
    root.mkdir(parents=True, exist_ok=True)
    builds = start_builds(args, root)

    spec = resolve_spec(compose([f"+module={args.module}", f"target={args.target}"]))
    device = spec.device
    module = instantiate_module(spec)  # seeded: the same weights as the packages
    example = make_inputs(spec)  # the seeded example inputs the builds use...
    example.kwargs.update(spec.kwargs)  # ...and the constant kwargs, as eager and the raw export take them
    raw_builds = {}
    for external in (False, True) if "external" in args.weights else (False,):
        with torch.no_grad():
            raw_builds[external] = raw_aoti(module, example, root, external)
        times = raw_builds[external][1]
        print(f"raw AOTInductor{' (external)' if external else ''}: export {times['export']:.1f}s, "
              f"compile {times['compile']:.1f}s  [{time.perf_counter() - began:.0f}s]", flush=True)  # fmt: skip
    code = builds.wait()
    print(f"flashrt_build sweep finished with exit code {code}  [{time.perf_counter() - began:.0f}s]", flush=True)
    summary = json.loads((root / "sweep" / "sweep_summary.json").read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.copy(root / "sweep" / "sweep_summary.md", args.out / f"gpu_{args.module}_sweep_summary.md")
    if code != 0:
        print((root / "builds.log").read_text()[-5000:])
        raise SystemExit(f"flashrt_build sweep failed with exit code {code}")

    def call(fn: Any) -> Any:
        return lambda: fn(*example.args, **example.kwargs)

    results: dict[str, dict[str, Any]] = {}
    runners: dict[str, Any] = {}

    def add(
        name: str, fn: Any, load_s: float | None, mem: int, build: dict | None, size: float | None, read_s=None
    ) -> None:
        runners[name] = fn
        results[name] = {"load_s": load_s, "mem_added_mb": mem / 2**20, "build_s": build, "package_mb": size}
        results[name]["sidecar_read_s"] = read_s

    add("eager", call(module), None, 0, None, None)
    compiled = torch.compile(module)
    start = time.perf_counter()
    with torch.no_grad():
        call(compiled)()
    sync(device)
    add("torch.compile", call(compiled), None, 0, {"compile": time.perf_counter() - start}, None)

    raw_path, raw_build = raw_builds[False]
    raw, seconds, mem = timed_load(device, lambda: torch._inductor.aoti_load_package(str(raw_path)))
    add("raw AOTI", call(raw), seconds, mem, raw_build, raw_path.stat().st_size / 1e6)
    if True in raw_builds:
        path, build = raw_builds[True]
        raw, seconds, mem = timed_load(device, lambda: load_raw_external(path, module))
        add("raw AOTI external, eager's weights", call(raw), seconds, mem, build, path.stat().st_size / 1e6)

    for row in summary["rows"]:
        out = Path(row["output_dir"])
        profile = next(o.split("=")[1] for o in row["overrides"] if o.startswith("inductor="))
        weights = row["weights"]["mode"]
        name = f"flashrt {weights} {profile}"
        read = timed_read(device, out / "weights.safetensors") if weights == "external" else None
        loaded, seconds, mem = timed_load(device, lambda out=out: flashrt_build.load(out))
        size = row["package"]["bytes"] / 1e6
        add(name, call(loaded), seconds, mem, row["timings"], size, read)
        if weights == "external":
            bound, seconds, mem = timed_load(device, lambda out=out: flashrt_build.load(out, host=module))
            add(f"{name}, eager's weights", call(bound), seconds, mem, None, size)
    weight_mb = sum(t.numel() * t.element_size() for t in module.state_dict().values()) / 2**20
    print(f"loaded {len(runners)} variants  [{time.perf_counter() - began:.0f}s]", flush=True)

    names = list(runners)
    with torch.no_grad():  # every variant computes what eager computes: the largest difference, recorded
        reference = [t.float() for t in torch.utils._pytree.tree_leaves(runners["eager"]()) if torch.is_tensor(t)]
        for name in names:
            leaves = [t.float() for t in torch.utils._pytree.tree_leaves(runners[name]()) if torch.is_tensor(t)]
            diffs = [(a - b).abs().max().item() for a, b in zip(leaves, reference, strict=False)]
            results[name]["max_abs_err_vs_eager"] = max(diffs, default=float("nan"))
    per_round: dict[str, list[float]] = {n: [] for n in names}
    calls: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            times = time_calls(runners[name], device, args.iters, args.warmup)
            per_round[name].append(statistics.median(times))
            calls[name] += times
        print(f"round {r + 1}: " + ", ".join(f"{n} {per_round[n][-1]:.3f}" for n in names), flush=True)
    for name in names:
        results[name]["latency_ms"] = {
            "median": statistics.median(calls[name]),
            "p10": percentile(calls[name], 0.1),
            "p90": percentile(calls[name], 0.9),
            "round_medians": per_round[name],
        }

    record = {
        "module": args.module,
        "target": {"device": device, "dtype": spec.dtype},
        "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None,
        "torch": torch.__version__,
        "cxx": os.environ.get("CXX"),
        "rounds": args.rounds,
        "concurrent_builds": args.jobs,
        "iters": args.iters,
        "weights_mb": weight_mb,
        "results": results,
        "goals": goals(results, args.module, weight_mb),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"gpu_{args.module}" if device.startswith("cuda") else f"cpu_smoke_{args.module}"
    (args.out / f"{stem}.json").write_text(json.dumps(record, indent=2) + "\n")
    text = render(record)
    (args.out / f"{stem}.md").write_text(text)
    print(text)


def goals(results: dict[str, dict[str, Any]], module: str, weight_mb: float) -> list[dict[str, Any]]:
    """The goals of the GPU record, each with the measured ratio and met or not."""
    ms = {name: r["latency_ms"]["median"] for name, r in results.items()}
    flashrt = {n: v for n, v in ms.items() if n.startswith("flashrt") and "eager's" not in n}
    checks = []
    # flashrt_build against the raw API with the same options and weights mode
    pairs = [("flashrt baked default", "raw AOTI"), ("flashrt external default", "raw AOTI external, eager's weights")]
    for name, raw in pairs:
        if name in ms and raw in ms:
            rounds = results[raw]["latency_ms"]["round_medians"]
            spread = (max(rounds) - min(rounds)) / ms[raw]
            ratio = ms[name] / ms[raw]
            checks.append(goal(f"{name} within 1.05x of {raw} (raw's round spread {spread:.1%})", ratio, ratio <= 1.05))
    default = {n: v for n, v in flashrt.items() if n.endswith(" default")}
    if default:
        name = min(default, key=default.get)
        ratio = ms[name] / ms["torch.compile"]
        checks.append(goal(f"{name} at least as fast as torch.compile (time ratio)", ratio, ratio <= 1.0))
    best = min(flashrt, key=flashrt.get)
    speedup = ms["torch.compile"] / ms[best]
    wanted = 2.0 if module == "bert_base" else 1.5
    checks.append(goal(f"{best} at least {wanted:g}x faster than torch.compile (speed-up)", speedup, speedup >= wanted))
    for name in results:
        if name.startswith("flashrt") and name.endswith("eager's weights"):
            added = results[name]["mem_added_mb"]
            checks.append(goal(f"loading {name}: device memory added (MB; weights {weight_mb:.0f} MB)", added,
                               added <= max(16.0, 0.01 * weight_mb)))  # fmt: skip
        if name.startswith("flashrt external") and "eager's" not in name and weight_mb > 1000:
            size = results[name]["package_mb"]
            checks.append(goal(f"{name}: package MB under 5 for {weight_mb / 1024:.1f} GB of weights", size, size < 5))
    for name, value in flashrt.items():
        if "external" not in name:
            continue
        baked = name.replace("external", "baked")
        if baked not in ms and name.endswith(" default"):
            baked = "raw AOTI"  # no flashrt baked build: the raw API's baked package, same options
        if baked in ms:
            ratio = value / ms[baked]
            checks.append(goal(f"{name} within 1.10x of {baked} (baked)", ratio, ratio <= 1.10))
    return checks


def goal(text: str, value: float, met: bool) -> dict[str, Any]:
    return {"goal": text, "measured": round(value, 3), "met": bool(met)}


def render(record: dict[str, Any]) -> str:
    rows = []
    for name, r in record["results"].items():
        lat = r["latency_ms"]
        rounds = ", ".join(f"{v:.3f}" for v in lat["round_medians"])
        build = ", ".join(f"{k} {v:.1f}" for k, v in (r["build_s"] or {}).items())
        load = f"{r['load_s']:.2f}" if r["load_s"] is not None else ""
        size = f"{r['package_mb']:.1f}" if r["package_mb"] else ""
        read = f"{r['sidecar_read_s']:.2f}" if r.get("sidecar_read_s") is not None else ""
        cells = [name, f"{lat['median']:.3f}", rounds, f"{lat['p10']:.3f}-{lat['p90']:.3f}", load, read]
        rows.append([*cells, f"{r['mem_added_mb']:.0f}", size, build, f"{r['max_abs_err_vs_eager']:.2g}"])
    header = ["variant", "median ms", "round medians", "p10-p90", "load s", "sidecar read s", "device MB added"]
    header += ["package MB", "build s", "max err vs eager"]
    goals = [[g["goal"], f"{g['measured']:.3f}", "yes" if g["met"] else "**no**"] for g in record["goals"]]
    title = f"### {record['module']} ({record['target']['dtype']}, {record['gpu'] or 'CPU'}, torch {record['torch']})"
    return f"{title}\n\n{table(header, rows, 'lrllrrrrlr')}\n{table(['goal', 'measured', 'met'], goals, 'lrl')}"


if __name__ == "__main__":
    main()
