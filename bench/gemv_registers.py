"""Registers a thread of the GEMV kernel takes at each launch, bf16 and
int8 rows, plain and glu: compiled by Triton for sm_90a and counted by
ptxas (`-v`), no GPU needed. The kernel sums a fp32 product per weight
element it loads (BLOCK_N x BLOCK_K a program), so its registers bound how
many programs an SM holds and so the weight bytes in flight, int8's half
of bf16's at one launch. Also the SASS instructions of its K loop
(nvdisasm), a K step and a weight element: an int8 byte takes more than
a bf16 element (unpacked, widened, and x exchanged through shared memory
to the bytes' layout).

    python bench/gemv_registers.py
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flashrt_build.stages.gemv import NORM  # noqa: E402
from flashrt_build.stages.triton_kernels import flashrt_pdl_gemv  # noqa: E402

# block_n, block_k, warps, K tiles a program has in flight (gemv.PREFETCH: 2 loads the next tile before the sums)
LAUNCHES = [(2, 512, 4, 1), (2, 1024, 4, 1), (2, 1024, 4, 2), (2, 2048, 4, 1), (4, 1024, 4, 1), (4, 1024, 8, 1),
            (8, 512, 4, 1)]  # fmt: skip
REGISTERS_AN_SM, WARP = 65536, 32


def compiled(weight: str, block_n: int, block_k: int, warps: int, prefetch: int, glu: bool) -> tuple[int, int]:
    """(registers a thread, SASS instructions in its K loop) of the kernel as a normed GEMV calls it (PDL on,
    evict-first, one stage): ptxas -v, and nvdisasm over its cubin (the loop: the longest backward branch)."""
    types = {name: "*bf16" for name in ("x_ptr", "v_ptr", "b_ptr", "r_ptr", "y_ptr")}
    types |= {"w_ptr": weight, "s_ptr": "*fp32", "N": "i32", "K": "i32", "eps": "fp32"}
    constexprs = dict(PROLOGUE=NORM, HAS_BIAS=False, HAS_RESIDUAL=False, HAS_SCALE=weight == "*i8", BLOCK_N=block_n,
                      BLOCK_K=block_k, EVICT=True, PDL=2, GLU=glu, PREFETCH=prefetch, INT8_BITS=True)  # fmt: skip
    registers, sass = assembled(sm90_ptx(flashrt_pdl_gemv, types, constexprs, warps))
    return registers, loop_instructions(sass)


def sm90_ptx(fn: Any, types: dict[str, str], constexprs: dict[str, Any], warps: int) -> str:
    """A Triton kernel's PTX for sm_90 (one stage), its pointers and integers `types` (16-byte aligned, as torch's
    tensors and the decode shapes are), the rest of its arguments `constexprs`."""
    source = ASTSource(
        fn=fn,
        signature={name: types.get(name, "constexpr") for name in fn.arg_names},
        constexprs={(fn.arg_names.index(name),): value for name, value in constexprs.items()},
        attrs={(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name in types},
    )
    options = {"num_warps": warps, "num_stages": 1}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def assembled(ptx: str) -> tuple[int, list[str]]:
    """(registers a thread, SASS lines) of a kernel's PTX for sm_90a: Triton's own ptxas and nvdisasm."""
    tools = Path(triton.__file__).parent / "backends/nvidia/bin"
    with tempfile.TemporaryDirectory() as work:
        (path := Path(work) / "kernel.ptx").write_text(ptx)
        done = subprocess.run([os.fspath(tools / "ptxas"), "-v", "--gpu-name", "sm_90a", str(path), "-o",
                               f"{work}/kernel.cubin"], capture_output=True, text=True, check=True)  # fmt: skip
        sass = subprocess.run([os.fspath(tools / "nvdisasm"), "-c", f"{work}/kernel.cubin"], capture_output=True,
                              text=True, check=True).stdout.splitlines()  # fmt: skip
    (line,) = [line for line in done.stderr.splitlines() if "registers" in line]
    return int(line.split("Used")[1].split()[0]), sass


def loop_instructions(sass: list[str]) -> int:
    """Instructions between a label and the furthest branch back to it: the kernel's K loop."""
    labels = {match.group(1): i for i, line in enumerate(sass) if (match := re.match(r"\s*(\.L_x_\d+):", line))}
    loops = [(i - labels[match.group(1)], labels[match.group(1)], i) for i, line in enumerate(sass)
             if (match := re.search(r"BRA `\((\.L_x_\d+)\)", line)) and labels.get(match.group(1), i) < i]  # fmt: skip
    _, start, end = max(loops)
    return sum(bool(re.search(r"/\*[0-9a-f]{4}\*/", line)) for line in sass[start : end + 1])


def main() -> None:
    print("| weights | launch (block_n, block_k, warps, tiles in flight) | glu | registers a thread | programs an SM "
          "| weight bytes in flight an SM (KB) | instructions a K step | a weight element |")  # fmt: skip
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for (weight, size), launch, glu in itertools.product((("*bf16", 2), ("*i8", 1)), LAUNCHES, (False, True)):
        block_n, block_k, warps, tiles = launch
        count, loop = compiled(weight, *launch, glu)
        programs = REGISTERS_AN_SM // (count * warps * WARP)
        in_flight = programs * tiles * block_n * (2 if glu else 1) * block_k * size / 1024
        elements = block_n * (2 if glu else 1) * block_k / (warps * WARP)  # a thread's, a K step
        print(f"| {weight[1:]} | {launch} | {'yes' if glu else 'no'} | {count} | {programs} | {in_flight:.0f} "
              f"| {loop} | {loop / elements:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
