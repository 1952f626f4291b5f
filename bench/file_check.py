"""The digest check a load makes, against one sha256 and against the disk.

    .venv/bin/python bench/file_check.py --mb 1024 --rounds 5

A synthetic file of `--mb` MiB gets the manifest record a build writes
(`file_record`: whole sha256 + 32 MiB chunk digests). Then, in alternating
order each round: `read()` of the whole file in 1 MiB blocks, one sha256 of
it (`file_sha256`: what a load did before chunk digests), and the check a load
makes now (`altered_digest`: the chunks on one thread per usable core). Each is
timed warm (page cache) and cold (the file's pages dropped first with
posix_fadvise DONTNEED). GB/s medians; the goal: the check runs at disk speed
(cold check / cold read >= 0.95). The C++ library runs the same check
(`bench/cpp_runner.py`, column "chunk digests").
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from report import publish  # noqa: E402

from flashrt_build.runtime.hashing import altered_digest, file_record, file_sha256, hashing_threads  # noqa: E402


def read_all(path: Path) -> None:
    with open(path, "rb", buffering=0) as f:
        while f.read(1 << 20):
            pass


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where the file goes (default: the temp dir)")
    parser.add_argument("--out-name", default="file_check")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "big.bin"
        with open(path, "wb") as f:
            block = os.urandom(1 << 20)
            for _ in range(args.mb):
                f.write(block)
        record = file_record(path)
        ways: dict[str, Callable[[], object]] = {
            "read": lambda: read_all(path),
            "sha256, one core": lambda: file_sha256(path),
            "chunk digests, all cores": lambda: altered_digest(path, record) is None or sys.exit("chunks disagree"),
        }
        gbs: dict[str, dict[str, list[float]]] = {way: {"warm": [], "cold": []} for way in ways}
        size_gb = path.stat().st_size / 1e9
        for r in range(args.rounds):
            order = list(ways)[r % len(ways) :] + list(ways)[: r % len(ways)]
            for way in order:
                ways[way]()  # warm the page cache
                gbs[way]["warm"].append(size_gb / timed(ways[way]))
                drop_cache(path)
                gbs[way]["cold"].append(size_gb / timed(ways[way]))

    med = {way: {k: statistics.median(v) for k, v in d.items()} for way, d in gbs.items()}
    chunks = "chunk digests, all cores"
    lines = [
        f"{args.mb} MiB file, {len(record['chunk_sha256'])} chunks of {record['chunk_bytes'] >> 20} MiB, "
        f"{hashing_threads()} usable cores, {args.rounds} rounds (order rotating); GB/s, median (range)",
        "",
        "| way | warm | cold |",
        "|---|---|---|",
    ]
    for way, d in gbs.items():
        cells = [f"{med[way][k]:.2f} ({min(v):.2f}-{max(v):.2f})" for k, v in d.items()]
        lines.append(f"| {way} | {' | '.join(cells)} |")
    cold_vs_disk = med[chunks]["cold"] / med["read"]["cold"]
    lines += [
        "",
        f"- chunk digests / one sha256: {med[chunks]['warm'] / med['sha256, one core']['warm']:.2f}x warm, "
        f"{med[chunks]['cold'] / med['sha256, one core']['cold']:.2f}x cold",
        f"- chunk digests / disk read, cold: {cold_vs_disk:.2f} "
        f"(goal: the disk's pace, >= 0.95: {'met' if cold_vs_disk >= 0.95 else 'not met'})",
    ]
    command = " ".join(["python bench/file_check.py", *sys.argv[1:]])
    title = "The load's digest check against the disk"
    publish(HERE / "results" / f"{args.out_name}.md", title, command, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
