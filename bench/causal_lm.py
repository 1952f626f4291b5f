"""A transformers LLM served from a causal_lm package against what a user of
transformers would run instead: the same save_pretrained directory loaded by
transformers with a StaticCache, its forward under
`torch.compile(mode="reduce-overhead")` (through `flashrt_build.causal_lm`'s
eager module, which is that forward with the cache bound).

    CXX=g++-12 python bench/causal_lm.py            # H200: a Llama-3.2-1B-shaped model, random weights, bf16
    python bench/causal_lm.py --target cpu --size layers=2,hidden=64,heads=4,kv_heads=2,mlp=128,vocab=256 \\
        --prompt 16 --new 8 --steps 3 --rounds 2 --no-cpp   # a smoke run

Writes the model with save_pretrained (bf16, tied embeddings), builds it
through the CLI (`+module=causal_lm`, external weights, CUDA graphs by
default), then times, alternating in `--rounds` rounds: a decode step
replayed from a graph and a `--prompt`-token prefill, package against
reduce-overhead; then `--prompt` + `--new` tokens, greedy, in Python, in C++
(flashrt-generate) and through reduce-overhead, the tokens compared with
transformers' own eager `generate`. Kernels per decode step are counted
from a plain (graph-free) call. Figures: bench/results/causal_lm.{md,json}.

More packages side by side: `--passes none,llm` (one per `passes` group) and
`--variant LABEL:OVERRIDES` (any overrides, e.g. per-method Inductor options);
`--only decode` (or `prefill`) builds and times that method alone, for a
device run that must fit its time limit.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from report import RESULTS, BuildFailed, build_root, cli_build, publish, table  # noqa: E402
from serve_llm import cpp_generate_tool, profile_step, sync, timed  # noqa: E402

import flashrt_build  # noqa: E402
from flashrt_build.causal_lm import CausalLM  # noqa: E402

# Llama-3.2-1B's shape: 16 layers, 2048 wide, 32 heads, 8 KV heads, an 8192 MLP, 128256 tokens, tied embeddings.
LLAMA_1B = "layers=16,hidden=2048,heads=32,kv_heads=8,mlp=8192,vocab=128256"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="cuda")
    parser.add_argument("--size", default=LLAMA_1B)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--cache", type=int, default=1024, help="module.max_cache_len")
    parser.add_argument("--steps", type=int, default=50, help="steps per timed sample")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-cpp", action="store_true", help="skip flashrt-generate")
    parser.add_argument("--extra", action="append", default=[], metavar="OVERRIDE", help="more build overrides")
    parser.add_argument("--out-name", default="causal_lm")
    parser.add_argument("--work", help="build here and keep the model and its build (a rerun reuses them)")
    parser.add_argument(
        "--passes", default="none", help="comma-separated `passes` groups, a package each, side by side"
    )
    parser.add_argument(
        "--variant", action="append", default=[], metavar="LABEL:OVERRIDES",
        help="one more package, built with these space-separated overrides on top (e.g. 'tuned:passes=llm "
        "+inductor.options.coordinate_descent_tuning=true')",
    )  # fmt: skip
    parser.add_argument("--no-generation", action="store_true", help="skip the generation runs (tokens/s, tokens)")
    parser.add_argument(
        "--only", choices=("prefill", "decode"), help="packages of this method alone (quicker builds), timed alone"
    )
    parser.add_argument("--no-baseline", action="store_true", help="packages only: no transformers + reduce-overhead")
    parser.add_argument("--jobs", type=int, default=1, help="packages built at once (compiling is CPU work)")
    args = parser.parse_args()
    device = torch.device(args.target)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with build_root(args.work) as root:
        directory = save_model(Path(root) / "model", args.size, dtype)
        overrides = ["+module=causal_lm", f"module.pretrained={directory}", f"module.max_cache_len={args.cache}",
                     f"module.max_prompt={args.prompt}", f"target={args.target}", "weights=external",
                     *(["serve.cuda_graphs=true"] if device.type == "cuda" else []),
                     *[f"~module.methods.{m}" for m in ("prefill", "decode") if args.only not in (None, m)],
                     *args.extra]  # fmt: skip
        variants = {f"passes={passes}": [f"passes={passes}"] for passes in args.passes.split(",") if passes}
        variants |= {label: more.split() for label, _, more in (v.partition(":") for v in args.variant)}

        def build(label: str) -> dict[str, Any]:
            more = variants[label]
            try:
                out, manifest, build_s = cli_build([*overrides, *more], Path(root) / "out" / label.replace("=", "-"))
            except BuildFailed as failed:  # the others are still measured; this one is reported as failed
                return {"failed": str(failed), "overrides": more}
            compile_s = {k: v for k, v in manifest["timings"].items() if k.startswith("compile")}
            passes = {k: v for k, v in manifest.get("passes", {}).items() if k != "fuse_projections"}  # what each did
            weight_bytes = step_bytes(manifest)
            return {"out": out, "build_s": build_s, "compile_s": compile_s, "overrides": more, "passes": passes,
                    "weight_bytes": weight_bytes}  # fmt: skip

        # Each build is its own CLI process: --jobs of them compile side by side, their build seconds sharing the CPU.
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            built = dict(zip(variants, pool.map(build, variants), strict=True))
        builds = {name: b for name, b in built.items() if "failed" not in b}
        failed = {name: b for name, b in built.items() if "failed" in b}
        if not builds:
            raise SystemExit("every build failed: " + "; ".join(f"{n}: {b['failed']}" for n, b in failed.items()))
        results = measure(args, directory, builds, device, dtype)
        results["builds"] = {name: {k: v for k, v in b.items() if k != "out"} for name, b in built.items()}
        command = "python bench/causal_lm.py " + " ".join(sys.argv[1:])
        (RESULTS / f"{args.out_name}.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
        publish(RESULTS / f"{args.out_name}.md", "causal_lm against transformers + reduce-overhead", command,
                report(results, args))  # fmt: skip
        if failed:  # the figures of the others are published; the run still says it failed
            raise SystemExit(f"{len(failed)} of {len(built)} builds failed: {', '.join(failed)}")


def step_bytes(manifest: dict[str, Any]) -> int | None:
    """The bytes of weights a decode step reads whole: the sidecar's tensors
    less an embedding table no lm_head shares (a step reads one row of it:
    an lm_head quantized apart from the embedding it was tied to)."""
    tensors = (manifest.get("weights") or {}).get("tensors")
    if not tensors:
        return None
    size = lambda t: torch.Size(t["shape"]).numel() * getattr(torch, t["dtype"]).itemsize  # noqa: E731
    if not any(t["fqn"].startswith("lm_head.") for t in tensors):  # tied: the lm_head reads the table whole
        return sum(size(t) for t in tensors)
    indexed = [t for t in tensors if t["fqn"].endswith("embed_tokens.weight") and not t.get("aliases")]
    return sum(size(t) for t in tensors) - sum(size(t) for t in indexed)


def save_model(directory: Path, size: str, dtype: torch.dtype) -> Path:
    """A random Llama of `size`, saved with save_pretrained (kept under --work)."""
    import transformers

    if (directory / "config.json").is_file():
        return directory
    s = dict(part.split("=") for part in size.split(","))
    config = transformers.LlamaConfig(
        num_hidden_layers=int(s["layers"]), hidden_size=int(s["hidden"]), num_attention_heads=int(s["heads"]),
        num_key_value_heads=int(s["kv_heads"]), intermediate_size=int(s["mlp"]), vocab_size=int(s["vocab"]),
        max_position_embeddings=131072, tie_word_embeddings=True, rope_theta=500000.0,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(dtype).save_pretrained(directory)
    return directory


def measure(args: argparse.Namespace, directory: Path, builds: dict[str, Any], device: torch.device,
            dtype: torch.dtype) -> dict:  # fmt: skip
    """Each package (`passes=NAME`) and transformers under reduce-overhead, alternating."""
    replayed = {name: flashrt_build.load(b["out"], device=device) for name, b in builds.items()}
    plain = {name: flashrt_build.load(b["out"], device=device, cuda_graphs=False)  # profiled: CUDA only
             for name, b in builds.items() if device.type == "cuda"}  # fmt: skip
    compiled: dict[str, Any] = {}  # transformers under reduce-overhead: the baseline, and generation's reference
    if not args.no_baseline or not (args.no_generation or args.only):  # else the 2.5 GB model is not loaded at all
        eager = CausalLM(str(directory), args.cache).to(device=device, dtype=dtype).eval()
        compiled = {name: torch.compile(getattr(eager, name), mode="reduce-overhead") for name in ("prefill", "decode")}
    vocab = json.loads((directory / "config.json").read_text())["vocab_size"]
    prompt = torch.randint(0, vocab, (1, args.prompt), generator=torch.Generator().manual_seed(0)).to(device)
    token = prompt[:, -1:].clone()
    at = torch.tensor([args.prompt], device=device)

    def step(call: Any) -> Any:
        def run() -> Any:
            if call in compiled.values():
                torch.compiler.cudagraph_mark_step_begin()
            with torch.no_grad():
                return call(token, at) if call is compiled.get("decode") else call(token, position=at)

        return run

    def prefill(call: Any) -> Any:
        def run() -> Any:
            if call is compiled.get("prefill"):
                torch.compiler.cudagraph_mark_step_begin()
            with torch.no_grad():
                return call(prompt)

        return run

    def label(name: str) -> str:
        return "package" if len(builds) == 1 else f"package {name}"

    results: dict[str, Any] = {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "size": args.size,
                               "packages": [label(name) for name in builds]}  # fmt: skip
    baseline = not args.no_baseline
    if args.only != "prefill":
        decode = {label(name): step(model.decode.run_trusted) for name, model in replayed.items()}
        decode |= {BASELINE: step(compiled["decode"])} if baseline else {}
        results["decode_ms"] = timed(decode, args, device)
        results["decode_profile"] = {label(name): profile_step(step(model.decode.run_trusted), device)
                                     for name, model in plain.items()}  # fmt: skip
    if args.only != "decode":
        prefills = {label(name): prefill(model.prefill) for name, model in replayed.items()}
        prefills |= {BASELINE: prefill(compiled["prefill"])} if baseline else {}
        results["prefill_ms"] = timed(prefills, args, device, steps=max(1, args.steps // 10))
    first = next(iter(builds))
    results["kernels_per_decode_step"] = (results.get("decode_profile", {}).get(label(first)) or {}).get("kernels")
    if not (args.no_generation or args.only):
        results["generation"] = generation(args, directory, builds[first]["out"], replayed[first], compiled, prompt,
                                           device, dtype)  # fmt: skip
    return results


BASELINE = "transformers, reduce-overhead"


def generation(
    args: argparse.Namespace, directory: Path, out: Path, replayed: Any, compiled: dict[str, Any],
    prompt: torch.Tensor, device: torch.device, dtype: torch.dtype,
) -> dict[str, Any]:  # fmt: skip
    """`--prompt` + `--new` tokens, greedy, each way: tokens/s over the whole, and the tokens."""
    import transformers

    runs: dict[str, dict[str, Any]] = {}
    replayed.reset_state()
    flashrt_build.generate(replayed, prompt, args.new)  # warm-up: captures
    replayed.reset_state()
    g = flashrt_build.generate(replayed, prompt, args.new, timed=True)
    runs["package (Python)"] = {"tokens_per_s": g.tokens_per_s, "tokens": g.tokens[0].tolist()}
    for _ in range(2):  # the second is timed: the first compiles and captures
        sync()
        start = time.perf_counter()
        with torch.no_grad():
            torch.compiler.cudagraph_mark_step_begin()
            token = compiled["prefill"](prompt)[:, -1].argmax(-1, keepdim=True)
            tokens = [token]
            for i in range(args.new - 1):
                torch.compiler.cudagraph_mark_step_begin()
                at = torch.tensor([prompt.shape[1] + i], device=device)
                token = compiled["decode"](token.clone(), at)[:, -1].argmax(-1, keepdim=True)
                tokens.append(token)
        sync()
        seconds = time.perf_counter() - start
    runs["transformers, reduce-overhead"] = {"tokens_per_s": args.new / seconds,
                                            "tokens": torch.cat(tokens, 1)[0].tolist()}  # fmt: skip
    if not args.no_cpp:
        ids = ",".join(map(str, prompt[0].tolist()))
        command = [str(cpp_generate_tool()), str(out), "--prompt", ids, "--tokens", str(args.new), "--warmup", "1",
                   "--json", *(["--cuda-graphs"] if device.type == "cuda" else [])]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode:
            raise SystemExit(f"flashrt-generate failed: {done.stderr}")
        said = json.loads(done.stdout)
        runs["package (C++ flashrt-generate)"] = {
            "tokens_per_s": said["tokens_per_s"],
            "tokens": said["tokens"],
        }
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to(device).eval()
    with torch.no_grad():
        reference = model.generate(prompt, do_sample=False, max_new_tokens=args.new, min_new_tokens=args.new,
                                   eos_token_id=None)[0, prompt.shape[1] :].tolist()  # fmt: skip
    for run in runs.values():
        run["same_tokens_as_transformers_eager"] = next(
            (i for i, (a, b) in enumerate(zip(run["tokens"], reference, strict=True)) if a != b), len(reference)
        )
    return runs


def report(results: dict[str, Any], args: argparse.Namespace) -> str:
    decode, prefill = results.get("decode_ms"), results.get("prefill_ms")
    packages = results.get("packages", ["package"])

    def ratio(section: dict[str, Any], a: str, b: str) -> float:
        pairs = zip(section[a]["samples"], section[b]["samples"], strict=True)
        return sorted(x / y for x, y in pairs)[len(section[a]["samples"]) // 2]

    replayed = " (CUDA graphs)" if results["device"].startswith("cuda") else ""
    against = [BASELINE] if BASELINE in (decode or prefill) else []
    header = ["", *[f"{p}{replayed}" for p in packages], *["transformers + reduce-overhead" for _ in against],
              *[f"{p} / transformers" for p in packages for _ in against]]  # fmt: skip
    rows = []
    sections = [(title, section) for title, section in (("decode step (ms)", decode),
                (f"prefill {args.prompt} (ms)", prefill)) if section]  # fmt: skip
    for title, section in sections:
        rows.append((title, *[f"{section[p]['median']:.3f}" for p in [*packages, *against]],
                     *[f"{ratio(section, p, b):.3f}" for p in packages for b in against]))  # fmt: skip
    text = f"{results['size']}, {results['dtype']} on {results['device']}\n\n"
    text += table(header, rows, "l" + "r" * (len(header) - 1))
    if len(packages) > 1:
        first = packages[0]
        text += (
            "\n\nPaired ratios against "
            + first
            + ": "
            + ", ".join(
                f"{p}: "
                + ", ".join(f"{title.split()[0]} {ratio(section, p, first):.3f}" for title, section in sections)
                for p in packages[1:]
            )
        )
    if args.jobs > 1:
        text += f"\n\nBuilt {args.jobs} at a time: each build's seconds shared the CPU with the others'."
    for name, build in results.get("builds", {}).items():
        text += f"\n\nBuild {name} (`{' '.join(build['overrides'])}`): "
        text += (f"**failed**: {build['failed']}" if "failed" in build else
                 f"{build['build_s']:.0f} s (compile: {build['compile_s']})")  # fmt: skip
        step = (decode or {}).get("package" if packages == ["package"] else f"package {name}")
        if step and build.get("weight_bytes"):  # the pace against the memory: a step reads each weight once
            gb, ms = build["weight_bytes"] / 1e9, step["median"]
            text += f"; weights a step reads {gb:.2f} GB, over its decode step {gb / ms:.2f} TB/s"
    for name, profile in (results.get("decode_profile") or {}).items():
        if profile:
            text += f"\n\n{name}: {profile['kernels']} kernels in a plain decode step, "
            text += f"GPU time {profile['gpu_ms']:.3f} ms:\n\n"
            top = [(f"`{n}`", str(c), f"{ms:.4f}") for n, c, ms in profile["top"]]
            text += table(["kernel", "launches", "ms"], top, "lrr")
    if results.get("generation"):
        text += "\n\n" + table(
            ["generation", "tokens/s", "tokens equal to transformers eager"],
            [(name, f"{run['tokens_per_s']:.1f}", f"{run['same_tokens_as_transformers_eager']} of {args.new}")
             for name, run in results["generation"].items()],
            "lrr",
        )  # fmt: skip
    return text + "\n"


if __name__ == "__main__":
    main()
