"""A 512-token prefill through four transformer-shaped blocks (the 1.2B
tiny_lm's widths: 2048 in, 6144/2048/8192/2048 out), compiled with
torch.compile under each quant recipe's Inductor options and a few others,
against bf16. A probe, not the benchmark: one compile and one timing per
row, to choose which options deserve a full build in bench/quant_llm.py.

    python bench/quant_prefill_probe.py   # H200: bench/results/quant_prefill_probe_h200.log

It answers two questions the full builds raised: does `max_autotune` (a
Triton matmul that could fuse int8's dequantization into its loads) close
int8's prefill gap, and what does fp8's `emulate_precision_casts` cost.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
from torch import nn
from torch._inductor import config as inductor_config
from torchao.quantization import (
    Float8DynamicActivationFloat8WeightConfig,
    Int8WeightOnlyConfig,
    PerRow,
    quantize_,
)

DIM = 2048
ROWS = 512


class Block(nn.Module):
    """The matmuls of a tiny_lm block at its shapes (attention itself left out)."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=bias)
        self.o = nn.Linear(DIM, DIM, bias=bias)
        self.up = nn.Linear(DIM, 4 * DIM, bias=bias)
        self.down = nn.Linear(4 * DIM, DIM, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.o(self.qkv(x)[..., :DIM])
        return x + self.down(nn.functional.gelu(self.up(x)))


def model(bias: bool) -> nn.Module:
    return nn.Sequential(*[Block(bias) for _ in range(4)]).to("cuda", torch.bfloat16).eval()


def milliseconds(fn: Any, x: torch.Tensor, calls: int = 50) -> float:
    for _ in range(5):
        fn(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn(x)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def measure(name: str, module: nn.Module, x: torch.Tensor, options: dict[str, Any]) -> None:
    torch._dynamo.reset()
    began = time.perf_counter()
    with inductor_config.patch(options):
        compiled = torch.compile(module)
        compiled(x)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - began
        ms = milliseconds(compiled, x)
    print(f"{name:32s} {ms:8.3f} ms  compile {seconds:6.1f} s", flush=True)


def main() -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        raise SystemExit("quant_prefill_probe needs a CUDA GPU of compute capability 8.9 or later")
    torch.manual_seed(0)
    x = torch.randn(1, ROWS, DIM, device="cuda", dtype=torch.bfloat16)
    # conf/quant/int8_wo.yaml's and fp8.yaml's options, written out.
    descent = dict(
        coordinate_descent_tuning=True,
        coordinate_descent_check_all_directions=True,
        force_fuse_int_mm_with_mul=True,
    )
    with torch.no_grad():
        biased = model(bias=True)
        measure("bf16 default", biased, x, {})
        int8 = copy.deepcopy(biased)
        quantize_(int8, Int8WeightOnlyConfig())
        measure("int8 recipe (cd, no pm)", int8, x, dict(descent, pattern_matcher=False))
        # fp8 per-row with a bias fails in cuBLASLt at 8192 inputs (BENCHMARKS.md).
        plain = model(bias=False)
        measure("bf16 nobias default", plain, x, {})
        fp8 = copy.deepcopy(plain)
        quantize_(fp8, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
        measure("fp8 nobias recipe", fp8, x, dict(descent, emulate_precision_casts=True))
        measure("fp8 nobias no emulate", fp8, x, descent)
        measure("int8 recipe + max_autotune", int8, x, dict(descent, pattern_matcher=False, max_autotune=True))
        measure("bf16 max_autotune", biased, x, dict(max_autotune=True))
        measure(
            "fp8 nobias recipe+max_autotune", fp8, x, dict(descent, emulate_precision_casts=True, max_autotune=True)
        )


if __name__ == "__main__":
    main()
