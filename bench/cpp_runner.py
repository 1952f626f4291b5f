"""The C++ library (cpp/) against Python's `flashrt_build.load` and libtorch's
bare loader: per-call latency, and open time split into hashing and binding.

    .venv/bin/python bench/cpp_runner.py                          # CPU: mlp (baked), gpt2_tiny (external)
    .venv/bin/python bench/cpp_runner.py --stage-deps             # here, for a GPU machine without the headers
    CXX=g++-12 python bench/cpp_runner.py --target cuda --packages llama_1b:external --calls 50 \
        --out-name cpp_runner_h200                                  # H200: llama_1b open time

1. Builds flashrt-bench with CMake (build/cpp, against this interpreter's
   torch) and each package with `flashrt_build.build` (verification included).
2. Per call, C++ vs Python on the same package and inputs: `--rounds` rounds,
   alternating a flashrt-bench process (its `Package::run`, libtorch's
   `AOTIModelPackageLoader::run` and `boxed_run` on the same bound tensors,
   rotating in-process over 3 sub-rounds) with this process calling
   `flashrt_build.load(dir)` (and its runner's bare `boxed_run`), also over
   3 sub-rounds. A sample is the best sub-round, in microseconds per call;
   ratios are taken round by round (paired), then their median.
3. Open, per package: `Package::open` (digest of model.pt2 and the sidecar,
   map and read, libtorch's loader, check and bind), twice in each of
   `--rounds` processes (the first pays OpenSSL's and the allocator's
   start-up), against libtorch's loader plus `load_constants` of the same
   sidecar with no digest and no check, and against `flashrt_build.load`. With `--cold`, each open first drops the
   files' pages from the page cache (posix_fadvise DONTNEED).
4. Hashing against the disk: GB/s of `read()` and of sha256, warm and cold,
   of each package's files and of a `--big-mb` synthetic file (tiny sidecars
   are too small to time).

Threads: `--threads` (default 1 for a CPU target: two cores shared with
other work make a 2-thread call's time swing by 3x; torch's default for a
CUDA target). Writes bench/results/<out-name>.json and .md.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from report import publish  # noqa: E402

import flashrt_build  # noqa: E402

BUILD = REPO / "build" / "cpp"
DEPS = REPO / "build" / "cpp-deps"


def stage_deps() -> None:
    """Copy the C++ library's build-time headers (nlohmann/json from this venv,
    OpenSSL's from this system) into build/cpp-deps, for a machine that has
    neither and cannot fetch them: carry build/cpp-deps there."""
    import importlib.util
    import shutil

    spec = importlib.util.find_spec("nlohmann_json")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("nlohmann-json is not installed here (pip install nlohmann-json==3.12.0)")
    shutil.rmtree(DEPS, ignore_errors=True)
    shutil.copytree(Path(spec.submodule_search_locations[0]) / "include" / "nlohmann", DEPS / "json" / "nlohmann")
    for include in (Path("/usr/include/openssl"), Path("/usr/include/x86_64-linux-gnu/openssl")):
        if include.is_dir():
            shutil.copytree(include, DEPS / "openssl" / "include" / "openssl", dirs_exist_ok=True)
    print(f"staged {DEPS}: carry it to the machine that runs this script")


def libcrypto() -> str | None:
    """The libcrypto this Python's hashlib loaded: present wherever Python is."""
    import _hashlib  # noqa: F401

    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcrypto" in line}
    return min(paths) if paths else None


def build_bench_tool(target: str = "flashrt-bench") -> Path:
    """flashrt-bench (or another of the library's tools), configured against this interpreter's torch."""
    configure = [
        "cmake", "-S", str(REPO / "cpp"), "-B", str(BUILD), f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
        f"-DPython3_EXECUTABLE={sys.executable}", "-DCMAKE_BUILD_TYPE=Release", "-DFLASHRT_BUILD_BENCH=ON",
    ]  # fmt: skip
    if (DEPS / "json").is_dir():
        configure.append(f"-DNLOHMANN_JSON_INCLUDE_DIR={DEPS / 'json'}")
    if (DEPS / "openssl").is_dir() and not Path("/usr/include/openssl/evp.h").exists():
        configure += [
            f"-DOPENSSL_INCLUDE_DIR={DEPS / 'openssl' / 'include'}",
            f"-DOPENSSL_CRYPTO_LIBRARY={libcrypto()}",
        ]
    BUILD.parent.mkdir(parents=True, exist_ok=True)
    # One configure of the build folder at a time: two test processes' CMake
    # runs each removed the other's compiler-probe folders (seen on a GPU host).
    with open(BUILD.parent / "cpp.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for command in (configure, ["cmake", "--build", str(BUILD), "-j", str(os.cpu_count() or 1), "-t", target]):
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode:
                sys.exit(f"{' '.join(command)} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    return BUILD / target


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def per_call_us(fn: Callable[[], object], calls: int, device: str) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync(device)
    return (time.perf_counter() - start) / calls * 1e6


def bench_tool(tool: Path, directory: Path, inputs: Path, args: argparse.Namespace, **options: Any) -> dict[str, Any]:
    command = [str(tool), str(directory), "--inputs", str(inputs)]
    command += ["--threads", str(args.threads)] if args.threads else []
    command += ["--device", args.device] if args.device else []
    for key, value in options.items():
        if value is not False:  # a flag given as True, or an option's value
            command += [f"--{key}"] if value is True else [f"--{key}", str(value)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        sys.exit(f"{' '.join(command)} failed: {done.stderr}")
    return json.loads(done.stdout)


def example_inputs(manifest: dict[str, Any], device: str) -> dict[str, torch.Tensor]:
    """Seeded inputs of the example shapes the manifest lists (token ids within the config's range)."""
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for spec in manifest["inputs"]:
        dtype = getattr(torch, spec["dtype"])
        if dtype.is_floating_point:
            value = torch.randn(spec["shape"], generator=generator).to(dtype)
        else:
            high = manifest["config"]["module"]["inputs"][spec["name"]].get("high") or 2
            value = torch.randint(0, high, spec["shape"], generator=generator, dtype=dtype)
        tensors[spec["name"]] = value.to(device)
    return tensors


def bench_package(tool: Path, module: str, weights: str, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    overrides = [f"+module={module}", f"weights={weights}", f"target={args.target}", f"output_root={root}"]
    print(f"building {module} ({weights}, {args.target})", flush=True)
    result = flashrt_build.build(flashrt_build.compose(overrides))
    device = args.device or result.manifest["target"]["device"]
    tensors = example_inputs(result.manifest, device)
    inputs = root / f"{module}-{weights}-inputs.safetensors"
    save_file({k: v.cpu().contiguous() for k, v in tensors.items()}, str(inputs))
    if args.threads:
        torch.set_num_threads(args.threads)
    record: dict[str, Any] = {"module": module, "weights": weights, "device": device, "calls": args.calls}

    # Per call: C++ processes and Python calls, alternating.
    calls: dict[str, list[float]] = {}
    if args.calls:
        loaded = flashrt_build.load(result.output_dir, device=device)
        boxed = loaded.methods[loaded.default_method].runner.loader.boxed_run
        flat = list(tensors.values())
        python = {
            "python flashrt_build.load": lambda: loaded(**tensors),
            "python boxed_run (no checks)": lambda: boxed(list(flat)),
        }
        with torch.no_grad():
            for fn in python.values():
                per_call_us(fn, max(args.calls // 10, 10), device)
            for r in range(args.rounds):
                cpp_first = r % 2 == 0
                for side in ("cpp", "python") if cpp_first else ("python", "cpp"):
                    # A sample: the best of 3 sub-rounds, the variants rotating, on either side.
                    if side == "cpp":
                        report = bench_tool(tool, result.output_dir, inputs, args, calls=args.calls, rounds=3, opens=0)
                        for name, values in report["calls"].items():
                            calls.setdefault(f"C++ {name}", []).append(min(values))
                    else:
                        best = {name: float("inf") for name in python}
                        for sub in range(3):
                            for name in list(python)[sub % 2 :] + list(python)[: sub % 2]:
                                best[name] = min(best[name], per_call_us(python[name], args.calls, device))
                        for name, value in best.items():
                            calls.setdefault(name, []).append(value)
        del loaded
    record["calls_us"] = calls

    # Open: C++ (its own split) and Python load, alternating.
    opens: list[list[dict[str, Any]]] = [[], []]  # the first open in a process, the second
    bare: list[float] = []
    python_open: list[float] = []
    for _ in range(args.rounds):
        report = bench_tool(tool, result.output_dir, inputs, args, calls=0, opens=2, cold=args.cold)
        for k in range(2):
            opens[k].append(report["open"][k])
        bare += report["bare_open_s"]
        files = report["files"]
        if args.cold:
            for name in ("model.pt2", "weights.safetensors"):
                if (result.output_dir / name).exists():
                    drop_cache(result.output_dir / name)
        sync(device)
        start = time.perf_counter()
        flashrt_build.load(result.output_dir, device=device)
        sync(device)
        python_open.append(time.perf_counter() - start)
    record.update(open=opens, bare_open_s=bare, python_load_s=python_open, files=files)
    return record


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def big_file_speeds(tool: Path, root: Path, megabytes: int, cold: bool) -> dict[str, Any]:
    """Read and hash GB/s of a synthetic safetensors file of `megabytes`."""
    path = root / "big.safetensors"
    save_file({"w": torch.randint(0, 255, (megabytes << 20,), dtype=torch.uint8)}, str(path))
    command = [str(tool), "--file", str(path), *(["--cold"] if cold else [])]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    path.unlink()
    return json.loads(done.stdout)


def med(values: list[float]) -> float:
    return statistics.median(values)


def ratio_row(samples: dict[str, list[float]], a: str, b: str, goal: str) -> str:
    """a / b round by round (paired samples), and of the two minimums."""
    paired = [x / y for x, y in zip(samples[a], samples[b], strict=True)]
    spread = f"{min(paired):.3f}-{max(paired):.3f}"
    return f"| {a} / {b} | {med(paired):.3f} | {spread} | {min(samples[a]) / min(samples[b]):.3f} | {goal} |"


def open_table(rec: dict[str, Any]) -> list[str]:
    """One package's open, split by step: the first open in a process and the second."""
    opens = rec["open"]
    pkg_bytes, w_bytes = opens[0][0]["package_bytes"], opens[0][0]["weights_bytes"]

    def cells(key: str, nbytes: int = 0) -> str:
        out = []
        for runs in opens:
            s = med([r[key] for r in runs])
            out.append(f"{s * 1e3:.2f} ms" + (f" ({nbytes / s / 1e9:.2f} GB/s)" if s and nbytes else ""))
        return " | ".join(out)

    bare, python = med(rec["bare_open_s"]) * 1e3, med(rec["python_load_s"]) * 1e3
    return [
        "",
        f"Open, {rec['module']} ({rec['weights']}, {rec['device']}): model.pt2 {pkg_bytes / 1e6:.2f} MB, "
        f"sidecar {w_bytes / 1e6:.2f} MB; medians of {len(opens[0])} processes",
        "",
        "| step | first open in a process | second open |",
        "|---|---:|---:|",
        f"| sha256 model.pt2 | {cells('package_hash_s', pkg_bytes)} |",
        f"| sha256 sidecar | {cells('weights_hash_s', w_bytes)} |",
        f"| map sidecar, parse its header | {cells('weights_read_s')} |",
        f"| libtorch loader (unzip, dlopen) | {cells('load_s')} |",
        f"| check and bind | {cells('bind_s')} |",
        f"| **`Package::open`, total** | {cells('total_s')} |",
        f"| libtorch loader + `load_constants` (no digest, no check), all opens | {bare:.2f} ms | |",
        f"| Python `flashrt_build.load` (torch imported), all rounds | | {python:.2f} ms |",
    ]


def markdown(records: list[dict[str, Any]], big: dict[str, Any] | None, args: argparse.Namespace) -> str:
    cold = ", cold" if args.cold else ""
    threads = f"{args.threads} thread(s)" if args.threads else "torch's threads"
    lines = [f"torch {torch.__version__}, {threads}, {args.rounds} rounds{cold}"]
    for rec in records:
        if not rec["calls_us"]:
            continue
        samples = rec["calls_us"]
        lines += [
            "",
            f"Per call, {rec['module']} ({rec['weights']}, {rec['device']}): a round is a flashrt-bench process "
            f"and the Python calls beside it; a sample is the best of 3 x {rec['calls']} calls",
            "",
            "| call | us per call, median | min | rounds |",
            "|---|---:|---:|---|",
        ]
        for name, values in samples.items():
            spread = ", ".join(f"{v:.1f}" for v in values)
            lines.append(f"| {name} | {med(values):.1f} | {min(values):.1f} | {spread} |")

        lines += [
            "",
            "| ratio | median of the rounds' ratios | range | ratio of the minimums | goal |",
            "|---|---:|---|---:|---|",
            ratio_row(samples, "C++ flashrt Package::run", "python flashrt_build.load", "<= 1.0"),
            ratio_row(samples, "C++ flashrt Package::run", "C++ libtorch run", "<= 1.02"),
            ratio_row(samples, "C++ flashrt Package::run", "C++ libtorch boxed_run", ""),
        ]
    for rec in records:
        lines += open_table(rec)
    files = [(f"{rec['module']} {f['file']}", f) for rec in records for f in rec["files"]]
    if big:
        files.append((f"synthetic {big['bytes'] / 2**20:.0f} MiB", big))
    lines += ["", "Read and hash speed, GB/s (warm: page cache; cold: pages dropped first)", ""]
    lines += ["| file | bytes | read | sha256, one core | chunk digests, all cores |", "|---|---:|---|---|---|"]
    for label, f in files:
        cells = []
        for way in ("read", "sha256", "sha256 chunks"):
            warm = f["warm"].get(way)
            cold = f.get("cold", {}).get(way)
            cells.append("-" if warm is None else f"{warm:.2f}" + (f" / cold {cold:.2f}" if cold else ""))
        lines.append(f"| {label} | {f['bytes']:,} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--packages", default="mlp:baked,gpt2_tiny:external", help="module:weights,...")
    parser.add_argument("--target", default="cpu")
    parser.add_argument("--device", default=None, help="default: the build's target device")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2000, help="calls per round; 0 times opens only")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads; default 1 for a CPU target")
    parser.add_argument("--cold", action="store_true", help="drop the files' pages before every open")
    parser.add_argument("--big-mb", type=int, default=1024, help="synthetic file for hash speed; 0: none")
    parser.add_argument("--out-name", default="cpp_runner")
    parser.add_argument("--stage-deps", action="store_true", help="only copy the build's headers to build/cpp-deps")
    args = parser.parse_args()
    if args.stage_deps:
        stage_deps()
        return
    if args.threads is None and args.target == "cpu":
        args.threads = 1
    tool = build_bench_tool()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        records = [bench_package(tool, *p.split(":"), root, args) for p in args.packages.split(",")]
        big = big_file_speeds(tool, root, args.big_mb, cold=True) if args.big_mb else None
    out = HERE / "results" / args.out_name
    raw = {"args": vars(args), "packages": records, "big_file": big}
    out.with_suffix(".json").write_text(json.dumps(raw, indent=1))
    command = " ".join(["python bench/cpp_runner.py", *sys.argv[1:]])
    publish(
        out.with_suffix(".md"),
        "Serving from C++: flashrt::Package against Python and libtorch",
        command,
        markdown(records, big, args),
    )


if __name__ == "__main__":
    main()
