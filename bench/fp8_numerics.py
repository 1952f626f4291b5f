"""What a compile adds to float8's error: a LayerNorm -> Linear -> GELU ->
Linear block in bf16, torchao's float8 per-row recipe applied, run eagerly and
through torch.compile with the fp8 recipe's Inductor options, with and
without `emulate_precision_casts`. Prints the compiled output's max abs and
norm-wise relative difference from eager's (CUDA, compute capability 8.9+).

    python bench/fp8_numerics.py        # on the H200: bench/results/fp8_numerics_h200.log

Float8 quantizes activations at run time, one scale per row from the row's
largest magnitude; a compiled kernel that skips a bf16 rounding eager does
gets a slightly different scale, and values land a float8 step apart.
"""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import OmegaConf
from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

RECIPE = Path(__file__).resolve().parent.parent / "conf" / "quant" / "fp8.yaml"


def main() -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        raise SystemExit("fp8_numerics needs a CUDA GPU of compute capability 8.9 or later")
    torch.manual_seed(0)
    block = torch.nn.Sequential(
        torch.nn.LayerNorm(2048), torch.nn.Linear(2048, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 2048)
    )
    block = block.cuda().bfloat16()
    quantize_(block, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
    x = torch.randn(1, 2, 2048, device="cuda", dtype=torch.bfloat16)
    shipped = OmegaConf.to_container(OmegaConf.load(RECIPE).inductor.options)
    without = {k: v for k, v in shipped.items() if k != "emulate_precision_casts"}
    variants = {
        "recipe options without emulate_precision_casts": without,
        "recipe options (conf/quant/fp8.yaml)": shipped,
        "default options": {},
    }
    with torch.no_grad():
        eager = block(x).float()
        for name, options in variants.items():
            torch._dynamo.reset()
            diff = torch.compile(block, options=options)(x).float() - eager
            print(f"{name}: max abs {diff.abs().max():.4f}, rel {diff.norm() / eager.norm():.4f}")


if __name__ == "__main__":
    main()
