"""Serving an LLM from a package against torch.compile: a decode step and a
prefill, replayed from CUDA graphs through `flashrt_build.load(...,
cuda_graphs=True)`, against the same package called plainly, a raw
`torch.cuda.CUDAGraph` around the package's own entry point, eager, and
`torch.compile(mode="reduce-overhead")` of the same eager module; then greedy
generation (prompt + new tokens) in Python, in C++ (flashrt-generate) and
through torch.compile, with the tokens compared with eager's.

    CXX=g++-12 python bench/serve_llm.py                      # H200: tiny_lm at 1.2B, bf16, external weights
    CXX=g++-12 python bench/serve_llm.py --no-cpp --out-name serve_llm_decode --vs-name coordinate-descent \\
        --vs '+inductor.methods.decode={coordinate_descent_tuning: true,
              coordinate_descent_check_all_directions: true, aggressive_fusion: true}'
    python bench/serve_llm.py --target cpu --size dim=64,heads=4,layers=2,vocab=256,max_len=64 \\
        --prompt 16 --new 8 --steps 5 --rounds 2              # a smoke run

Builds through the CLI (verification on: on a GPU it replays each method from
a graph too). Steps are timed back to back with CUDA events, `--steps` per
sample, the variants alternating in `--rounds` rounds; a figure is the
median sample, a ratio the median of the per-round ratios. The decode step's
inputs are fixed (a token at position `--prompt`), as a serving loop's are
in shape. `trusted` calls skip the check of declared value ranges (the one
check that waits for the device), as `generate` does for tokens it derived
itself.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from report import RESULTS, alternate, build_root, cli_build, publish, table  # noqa: E402

import flashrt_build  # noqa: E402
from flashrt_build.config.compose import compose  # noqa: E402
from flashrt_build.config.spec import resolve_spec  # noqa: E402
from flashrt_build.runtime.manifest import method_bindings  # noqa: E402
from flashrt_build.runtime.runner import load_package  # noqa: E402
from flashrt_build.stages.module import instantiate_module  # noqa: E402

BANDWIDTH = 4.3e12  # bytes/s a device-to-device copy moved on the H200 (read + written)
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="cuda")
    parser.add_argument("--size", default="dim=2048,heads=32,layers=22,vocab=32000,max_len=1024")
    parser.add_argument("--inductor", default="default", help="the Inductor profile (conf/inductor/)")
    parser.add_argument("--dtype", help="default: the target's (bfloat16 on cuda)")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--steps", type=int, default=50, help="steps per timed sample")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-cpp", action="store_true", help="skip flashrt-generate")
    parser.add_argument("--out-name", default="serve_llm")
    parser.add_argument("--work", help="build here and keep the builds (a rerun reuses them); default: a temp dir")
    parser.add_argument(
        "--vs",
        action="append",
        default=[],
        metavar="OVERRIDE",
        help="also build with this override (repeatable; unchanged methods reused) and time its decode side by side",
    )
    parser.add_argument("--vs-name", default="tuned", help="what the --vs build is called in the report")
    args = parser.parse_args()
    size = dict(pair.split("=") for pair in args.size.split(","))
    args.vocab = int(size["vocab"])
    overrides = ["+module=tiny_lm", f"target={args.target}", "weights=external", f"inductor={args.inductor}"]
    overrides += [f"module.model.{key}={value}" for key, value in size.items()]
    overrides += [f"target.dtype={args.dtype}"] if args.dtype else []
    overrides += [
        f"module.methods.prefill.inputs.input_ids.dynamic={{1: {{name: prompt, min: 2, max: {args.prompt}}}}}",
        f"module.methods.prefill.inputs.input_ids.high={size['vocab']}",
        f"module.methods.decode.inputs.input_ids.high={size['vocab']}",
        f"module.methods.decode.inputs.position.high={size['max_len']}",
    ]
    device = torch.device(args.target)
    # flashrt-generate builds beside the package (CMake and the compile each take minutes on a GPU machine)
    tool = None if args.no_cpp else ThreadPoolExecutor(1).submit(cpp_generate_tool)
    with build_root(args.work) as root:
        out, manifest, build_s = cli_build([*overrides, f"output_dir={root}/{args.inductor}"], root)
        other = None
        if args.vs:
            other = cli_build([*overrides, *args.vs, f"output_dir={root}/{args.vs_name}"], root)
        cpp = None if tool is None else tool.result()
        results = measure(args, out, manifest, overrides, device, cpp, other and other[0])
    results["build_s"] = build_s
    if other is not None:
        results["vs"] = {
            "name": args.vs_name,
            "overrides": args.vs,
            "build_s": other[2],
            "compile_s": {k: v for k, v in other[1]["timings"].items() if k.startswith("compile")},
            "compiled": {name: m["compiled"] for name, m in other[1]["methods"].items()},
            "inductor_options": {name: m["inductor_options"] for name, m in other[1]["methods"].items()},
            "verification_passed": other[1]["verification"]["passed"],
        }
    results["compile_s"] = {k: v for k, v in manifest["timings"].items() if k.startswith("compile")}
    results["verification_graphs"] = manifest["verification"].get("graphs")
    (RESULTS / f"{args.out_name}.json").write_text(json.dumps(results, indent=2))
    command = (
        "CXX=g++-12 python bench/serve_llm.py"
        + "".join(
            f" {flag} {value}"
            for flag, value, default in (
                ("--inductor", args.inductor, "default"),
                ("--rounds", args.rounds, 3),
                ("--steps", args.steps, 50),
                ("--out-name", args.out_name, "serve_llm"),
                ("--vs-name", args.vs_name, "tuned"),
            )
            if value != default
        )
        + (" --no-cpp" if args.no_cpp else "")
        + "".join(f" --vs '{override}'" for override in args.vs)
    )
    publish(RESULTS / f"{args.out_name}.md", "Serving an LLM: CUDA-graph replay against torch.compile", command,
            report(results, manifest, args))  # fmt: skip


def measure(
    args: argparse.Namespace,
    out: Path,
    manifest: dict[str, Any],
    overrides: list[str],
    device: torch.device,
    cpp: Path | None,
    other: Path | None = None,
) -> dict[str, Any]:
    on_gpu = device.type == "cuda"
    replayed = flashrt_build.load(out, cuda_graphs=on_gpu)
    plain = flashrt_build.load(out, cuda_graphs=False)
    eager = instantiate_module(resolve_spec(compose(overrides)))
    reduce_overhead = {
        "decode": torch.compile(eager.decode, mode="reduce-overhead", fullgraph=True),
        "prefill": torch.compile(eager.forward, mode="reduce-overhead", fullgraph=True, dynamic=False),
    }
    prompt = torch.randint(0, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(0)).to(device)
    token, position = prompt[:, :1].clone(), torch.tensor([args.prompt], device=device)

    def compiled(name: str) -> Callable[..., Any]:
        def call(*inputs: torch.Tensor) -> Any:
            torch.compiler.cudagraph_mark_step_begin()
            return reduce_overhead[name](*inputs)

        return call

    decode = {
        "eager": lambda: eager.decode(token, position),
        "torch.compile reduce-overhead": lambda: compiled("decode")(token, position),
        "package, plain call": lambda: plain.decode(token, position),
        "package, plain call, trusted": lambda: plain.decode.run_trusted(token, position),
        "package, graphs": lambda: replayed.decode(token, position),
        "package, graphs, trusted": lambda: replayed.decode.run_trusted(token, position),
    }
    if on_gpu:
        decode["raw CUDAGraph.replay of the package"] = raw_replay(out, manifest, replayed, [token, position])
    tuned = None
    if other is not None:  # bound to the same cache: each variant's step writes the same position
        tuned = flashrt_build.load(other, cuda_graphs=on_gpu)
        decode[f"package {args.vs_name}, graphs, trusted"] = lambda: tuned.decode.run_trusted(token, position)
    prefill = {
        "eager": lambda: eager(prompt),
        "torch.compile reduce-overhead": lambda: compiled("prefill")(prompt),
        "package, plain call": lambda: plain.prefill(prompt),
        "package, graphs": lambda: replayed.prefill(prompt),
    }
    with torch.no_grad():
        kernels = count_kernels(lambda: plain.decode(token, position), device)
        results: dict[str, Any] = {"decode_kernels": kernels}
        if tuned is not None:
            tuned_plain = flashrt_build.load(other, cuda_graphs=False)
            results["vs_decode_kernels"] = count_kernels(lambda: tuned_plain.decode(token, position), device)
            del tuned_plain
        results["decode_ms"] = timed(decode, args, device)
        results["prefill_ms"] = timed(prefill, args, device, steps=max(2, args.steps // 5))
        results["generation"] = generation(args, eager, reduce_overhead, replayed, plain, prompt, out, cpp)
        if manifest["target"]["dtype"] != "float32":  # where eager itself leaves float32's greedy path
            exact = instantiate_module(resolve_spec(compose([*overrides, "target.dtype=float32"])))
            reference = greedy_loop(exact, None, prompt, args.new)["tokens"]
            for summary in results["generation"].values():
                summary["same_tokens_as_float32_eager"] = agreeing(summary.pop("tokens"), reference)
            del exact
    weights = sum(math.prod(t["shape"]) * ITEMSIZE[t["dtype"]] for t in manifest["weights"]["tensors"])
    cache = manifest["state"]["state_bytes"]
    results["bytes"] = {"weights": weights, "kv_cache": cache}
    floor = {"weights": weights, "weights_and_cache": weights + cache}
    results["floor_ms"] = {name: 1e3 * size / BANDWIDTH for name, size in floor.items()}
    return results


def raw_replay(out: Path, manifest: dict[str, Any], loaded: Any, inputs: list[torch.Tensor]) -> Callable[[], Any]:
    """The package's decode model loaded on its own (single-threaded), bound
    to the same weights and cache, its `boxed_run` captured in a CUDA graph
    by hand: what the loader's replay costs on top of the graph itself."""
    runner = load_package(out / manifest["package"]["file"], 0, manifest["methods"]["decode"]["model"], True)
    names = method_bindings(manifest["weights"]["tensors"], "decode")
    own = {fqn: loaded.bound_weights[key] for fqn, key in names.items() if key in loaded.bound_weights}
    own.update({fqn: loaded.state[fqn] for fqn in runner.get_constant_fqns() if fqn in loaded.state})
    runner.load_constants(own, check_full_update=True, user_managed=True)
    static = [t.clone() for t in inputs]
    runner.loader.boxed_run(list(static))  # the warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        outputs = runner.loader.boxed_run(list(static))
    # The graph reads and writes these tensors' memory: freed, the allocator
    # hands it to other tensors and a replay reads garbage (a device-side
    # assert). Held by the partial, not by a statement `python -O` strips.
    return functools.partial(_replay, graph, (runner, own, static, outputs))


def _replay(graph: torch.cuda.CUDAGraph, _alive: tuple[Any, ...]) -> None:
    graph.replay()


def count_kernels(step: Callable[[], Any], device: torch.device) -> int | None:
    """CUDA kernels one plain decode step launches (a package loaded without
    graphs: with them, the profiled call would be a capture or a replay)."""
    profile = profile_step(step, device)
    return None if profile is None else profile["kernels"]


def profile_step(step: Callable[[], Any], device: torch.device, top: int = 15) -> dict[str, Any] | None:
    """One plain step under the profiler: its kernel count, their summed GPU
    time and the `top` kernels by time (name, launches, ms): where a step goes."""
    if device.type != "cuda":
        return None
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list[float]] = {}
    for event in kernels:
        by_name.setdefault(event.name, []).append(event.device_time_total / 1000)
    ranked = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:top]
    return {
        "kernels": len(kernels),
        "gpu_ms": sum(e.device_time_total for e in kernels) / 1000,
        "top": [(name[:90], len(times), round(sum(times), 4)) for name, times in ranked],
    }


def timed(
    variants: dict[str, Callable[[], Any]], args: argparse.Namespace, device: torch.device, steps: int | None = None
) -> dict[str, Any]:
    """ms per step of each variant: samples of `steps` steps back to back, alternating."""
    steps = steps or args.steps
    for name, step in variants.items():  # warm-up: first calls, captures, autotuning
        for _ in range(3):
            step()
        try:
            sync()
        except RuntimeError as error:  # a device-side assert surfaces here: name whose step it was
            raise RuntimeError(f"variant {name!r} failed in its warm-up") from error

    def sample(step: Callable[[], Any]) -> Callable[[], float]:
        def run() -> float:
            sync()
            if device.type == "cuda":
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                for _ in range(steps):
                    step()
                end.record()
                end.synchronize()
                return begin.elapsed_time(end) / steps
            start = time.perf_counter()
            for _ in range(steps):
                step()
            return 1e3 * (time.perf_counter() - start) / steps

        return run

    samples = alternate({name: sample(step) for name, step in variants.items()}, args.rounds)
    return {name: {"median": statistics.median(s), "samples": s} for name, s in samples.items()}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def generation(
    args: argparse.Namespace,
    eager: torch.nn.Module,
    reduce_overhead: dict[str, Callable[..., Any]],
    replayed: Any,
    plain: Any,
    prompt: torch.Tensor,
    out: Path,
    cpp: Path | None,
) -> dict[str, Any]:
    """Prompt + `--new` tokens, greedy, each way; tokens per second over the
    whole (the first token included) and the tokens themselves."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for _ in range(args.rounds):
        for name, model in (("package, graphs (Python)", replayed), ("package, plain (Python)", plain)):
            model.reset_state()
            g = flashrt_build.generate(model, prompt, args.new, timed=True)
            runs.setdefault(name, []).append(
                {"tokens_per_s": g.tokens_per_s, "prefill_ms": 1e3 * g.prefill_s,
                 "decode_ms_per_token": g.decode_ms_per_token, "tokens": g.tokens[0].tolist()}
            )  # fmt: skip
        for name, module in (("torch.compile reduce-overhead", reduce_overhead), ("eager", None)):
            runs.setdefault(name, []).append(greedy_loop(eager, module, prompt, args.new))
        if cpp is not None:
            ids = ",".join(map(str, prompt[0].tolist()))
            command = [str(cpp), str(out), "--prompt", ids, "--tokens", str(args.new), "--warmup", "1", "--json"]
            command += ["--cuda-graphs"] if prompt.device.type == "cuda" else []
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode:
                raise SystemExit(f"flashrt-generate failed: {done.stderr}")
            said = json.loads(done.stdout)
            runs.setdefault("package, graphs (C++ flashrt-generate)", []).append(said)
    reference = runs["eager"][0]["tokens"]
    summary = {}
    for name, samples in runs.items():
        tokens = samples[0]["tokens"]
        summary[name] = {
            "tokens": tokens,
            "tokens_per_s": statistics.median(s["tokens_per_s"] for s in samples),
            "prefill_ms": statistics.median(s["prefill_ms"] for s in samples),
            "decode_ms_per_token": statistics.median(s["decode_ms_per_token"] for s in samples),
            "same_tokens_as_eager": agreeing(tokens, reference),
            "tokens_stable": all(s["tokens"] == tokens for s in samples),
        }
    return summary


def agreeing(tokens: list[int], reference: list[int]) -> int:
    """How many leading tokens agree."""
    return next((i for i, (a, b) in enumerate(zip(tokens, reference, strict=True)) if a != b), len(reference))


def greedy_loop(
    eager: torch.nn.Module, compiled: dict[str, Callable[..., Any]] | None, prompt: torch.Tensor, new: int
) -> dict[str, Any]:
    """The same loop as `flashrt_build.generate`, on the eager module or its torch.compile."""
    eager.kv_cache.zero_()
    prefill = eager.forward if compiled is None else compiled["prefill"]
    decode = eager.decode if compiled is None else compiled["decode"]
    sync()
    start = time.perf_counter()
    if compiled is not None:
        torch.compiler.cudagraph_mark_step_begin()
    token = prefill(prompt)[:, -1].argmax(-1, keepdim=True)
    sync()
    prefill_s, start = time.perf_counter() - start, time.perf_counter()
    tokens = [token]
    for step in range(new - 1):
        if compiled is not None:
            torch.compiler.cudagraph_mark_step_begin()
        at = torch.full((1,), prompt.shape[1] + step, dtype=torch.int64, device=prompt.device)
        token = decode(token, at)[:, -1].argmax(-1, keepdim=True)
        tokens.append(token)
    sync()
    decode_s = time.perf_counter() - start
    return {
        "tokens_per_s": new / (prefill_s + decode_s),
        "prefill_ms": 1e3 * prefill_s,
        "decode_ms_per_token": 1e3 * decode_s / max(1, new - 1),
        "tokens": torch.cat(tokens, dim=1)[0].tolist(),
    }


def cpp_generate_tool() -> Path:
    """flashrt-generate, built against this interpreter's torch (bench/cpp_runner.py's build)."""
    from cpp_runner import build_bench_tool

    return build_bench_tool("flashrt-generate")


def ratio(results: dict[str, Any], section: str, a: str, b: str) -> float:
    """The median of per-round ratios a / b."""
    pairs = zip(results[section][a]["samples"], results[section][b]["samples"], strict=True)
    return statistics.median(x / y for x, y in pairs)


def report(results: dict[str, Any], manifest: dict[str, Any], args: argparse.Namespace) -> str:
    target = manifest["target"]
    text = (
        f"tiny_lm `{args.size}` on {target['device']} ({target['dtype']}), external weights, "
        f"inductor={args.inductor}, torch {torch.__version__}: "
        f"{results['bytes']['weights'] / 1e9:.2f} GB of weights, KV cache {results['bytes']['kv_cache'] / 1e6:.0f} MB; "
        f"built in {results['build_s']:.0f} s; {results['decode_kernels']} kernels in a plain decode step.\n\n"
    )
    rows = [[name, f"{v['median']:.3f}"] for name, v in results["decode_ms"].items()]
    text += "Decode step (ms, median of samples of steps back to back):\n\n" + table(["variant", "ms"], rows, "lr")
    rows = [[name, f"{v['median']:.3f}"] for name, v in results["prefill_ms"].items()]
    text += f"\nPrefill of {args.prompt} tokens (ms):\n\n" + table(["variant", "ms"], rows, "lr")
    compare, plain, raw = "torch.compile reduce-overhead", "package, plain call", "raw CUDAGraph.replay of the package"
    trusted, checked = "package, graphs, trusted", "package, graphs"
    ratios = [
        ("decode: graphs (trusted) / torch.compile reduce-overhead", "decode_ms", trusted, compare),
        ("decode: graphs (checked) / torch.compile reduce-overhead", "decode_ms", checked, compare),
        ("decode: graphs (trusted) / plain package call", "decode_ms", trusted, plain),
        ("prefill: graphs / plain package call", "prefill_ms", checked, plain),
        ("prefill: graphs / torch.compile reduce-overhead", "prefill_ms", checked, compare),
    ]
    if results.get("vs"):
        tuned = f"package {args.vs_name}, graphs, trusted"
        ratios.insert(0, (f"decode: {args.vs_name} / inductor={args.inductor} (graphs, trusted)",
                          "decode_ms", tuned, trusted))  # fmt: skip
        ratios.insert(1, (f"decode: {args.vs_name} (graphs) / torch.compile reduce-overhead",
                          "decode_ms", tuned, compare))  # fmt: skip
    if raw in results["decode_ms"]:
        ratios.insert(3, ("decode: loader's replay (trusted) / raw replay", "decode_ms", trusted, raw))
        ratios.insert(4, ("decode: loader's replay (checked) / raw replay", "decode_ms", checked, raw))
    rows = [[label, f"{ratio(results, section, a, b):.3f}"] for label, section, a, b in ratios]
    floor = results["floor_ms"]
    graphs = results["decode_ms"]["package, graphs, trusted"]["median"]
    rows.append(["decode: graphs (trusted) / bandwidth floor of the weights", f"{graphs / floor['weights']:.2f}"])
    rows.append(["decode: graphs (trusted) / floor of weights + cache", f"{graphs / floor['weights_and_cache']:.2f}"])
    text += "\nRatios (median of per-round ratios):\n\n" + table(["", "ratio"], rows, "lr")
    rows = [
        [name, f"{g['tokens_per_s']:.1f}", f"{g['prefill_ms']:.2f}", f"{g['decode_ms_per_token']:.3f}",
         f"{g['same_tokens_as_eager']} of {args.new}", str(g.get("same_tokens_as_float32_eager", "-")),
         "yes" if g["tokens_stable"] else "no"]
        for name, g in results["generation"].items()
    ]  # fmt: skip
    text += (
        f"\nGreedy generation, {args.prompt}-token prompt + {args.new} new tokens (median of {args.rounds} runs; "
        "the first token waits for the prefill on the host, the decode steps are queued back to back):\n\n"
    )
    text += table(
        ["", "tokens/s", "prefill ms", "decode ms/token", "leading tokens = eager's", "= float32 eager's", "stable"],
        rows,
        "lrrrrrl",
    )
    if results.get("vs"):
        v = results["vs"]
        compiles = ", ".join(f"{k} {s:.0f} s" for k, s in v["compile_s"].items()) or "nothing compiled"
        text += (
            f"\n{v['name']} ({' '.join(v['overrides'])}): built in {v['build_s']:.0f} s ({compiles}; "
            f"methods {v['compiled']}), "
            f"verified: {v['verification_passed']}; {results['vs_decode_kernels']} kernels in a plain "
            f"decode step; per-method options {v['inductor_options']}.\n"
        )
    if results.get("verification_graphs"):
        v = results["verification_graphs"]
        text += (
            f"\nThe build's verification replayed {v['calls']} calls from graphs ({v['captured']}): max abs error "
            f"{v['max_abs_err_vs_plain']:g} against the plain calls, {v['max_abs_err_vs_eager']:g} against eager.\n"
        )
    return text


if __name__ == "__main__":
    main()
