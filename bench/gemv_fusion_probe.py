"""The package's GEMV kernel (flashrt_build/stages/triton_kernels.py), probed on a GPU
at the decode step's shapes:

1. Its launch: the shipped configuration (gemv.py's: 2 rows a program, K in
   steps of 1024, 4 warps, one stage, weights loaded `evict_first`) against
   fewer or more rows and warps, wider steps, Triton's default pipelining
   and plain loads (the H100's run chose one stage and `evict_first` for
   every shape: bench/results/gemv_fusion_probe_h100.md, run before the
   kernel took them).
2. Its neighbours fused in, as the `gemv_fusion` pass fuses them: the
   RMSNorm before a projection (each program sums x*x over the K it reads
   anyway and scales its sums at the end: `y = rsqrt(mean(x^2) + eps) * W (x * g)`,
   no extra pass), SiLU(gate) * up before `down` or out of gate/up itself
   (GLU: the kernel as shipped), the residual add after `o`
   and `down`; each against the two kernels a package without the pass runs
   (a pointwise kernel, then the GEMV).
3. Programmatic dependent launch, as the `pdl` pass launches it: a decode
   step's chain of GEMVs (per layer the norm and q/k/v, o and the residual
   add, the norm and gate/up, SiLU, down and the residual add; the lm_head),
   each feeding the next, with and without the kernels' waits and the PDL
   launch (`--pdl-only`: this part alone); both chains must give the same
   bits. Both ways a kernel can let the next one launch (before its wait, as
   shipped: pdl.MODE, or after it), the kernel as it was before GLU, two K
   steps loaded before the wait (gemv.PREFETCH), and beside the shipped
   launch wider K steps (`--pdl-configs`): the GEMV loads its first step's
   weights before it waits, so a wider step streams more of them under the
   previous kernel's tail. Then the chain on int8 rows and their scales, as
   `quant=int8_wo`'s layers call the kernel (the lm_head bf16), at its
   shipped launch (gemv.INT8_LAUNCH) and beside it (INT8_CONFIGS), the
   lm_head at bf16's launch as a package launches it (`--int8-launches`:
   more launches, and the layers timed without the lm_head).

Every timing is a replayed CUDA graph over enough copies of the weight to
stream it from HBM, as `gemv_probe.py` times them.

    python bench/gemv_fusion_probe.py                   # a GPU: bench/results/gemv_fusion_probe_<gpu>.md
    python bench/gemv_fusion_probe.py --pdl-only        # 3. alone: bench/results/gemv_pdl_probe_<gpu>.md
    python bench/gemv_fusion_probe.py --int8-launches   # the int8 chain's launches: gemv_int8_launches_<gpu>.md
    TRITON_INTERPRET=1 python bench/gemv_fusion_probe.py --check   # the kernels' numerics on a CPU
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gemv_probe import SHAPES, int_list, replayed_us, streamed  # noqa: E402
from report import RESULTS, publish, table  # noqa: E402

from flashrt_build.stages.gemv import (  # noqa: E402
    EVICT,
    GATED,
    INT8_BITS,
    INT8_LAUNCH,
    LAUNCH,
    NONE,
    NORM,
    PREFETCH,
    STAGES,
    launch_rows,
)
from flashrt_build.stages.pdl import LAUNCH_THEN_WAIT, MODE, WAIT_THEN_LAUNCH  # noqa: E402
from flashrt_build.stages.triton_kernels import flashrt_pdl_gemv  # noqa: E402

# (block_n, block_k, warps, stages, evict_first): the shipped kernel's launch
SHIPPED = (*LAUNCH, STAGES, EVICT)
# int8 rows' launch (gemv.INT8_LAUNCH), and the pdl chain's int8 others: larger K steps, more warps or rows
INT8_SHIPPED = (*INT8_LAUNCH, STAGES, EVICT)
INT8_CONFIGS = [(2, 2048, 4, 1, True), (2, 2048, 8, 1, True), (4, 2048, 4, 1, True), (4, 2048, 8, 1, True),
                (8, 1024, 8, 1, True), (2, 4096, 8, 1, True)]  # fmt: skip


@triton.jit
def add_norm_kernel(x_ptr, r_ptr, g_ptr, h_ptr, y_ptr, K, eps, BLOCK: tl.constexpr):
    """What the package's norm kernels do, one program: h = x + r, y = g * h / rms(h)."""
    cols = tl.arange(0, BLOCK)
    h = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
    h += tl.load(r_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
    tl.store(h_ptr + cols, h.to(h_ptr.dtype.element_ty), mask=cols < K)
    y = h * tl.rsqrt(tl.sum(h * h, axis=0) / K + eps) * tl.load(g_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
    tl.store(y_ptr + cols, y.to(y_ptr.dtype.element_ty), mask=cols < K)


@triton.jit
def silu_mul_kernel(g_ptr, u_ptr, y_ptr, K, BLOCK: tl.constexpr):
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    g = tl.load(g_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
    tl.store(y_ptr + cols, (g * tl.sigmoid(g) * u).to(y_ptr.dtype.element_ty), mask=cols < K)


@triton.jit
def add_kernel(x_ptr, r_ptr, y_ptr, K, BLOCK: tl.constexpr):
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
    tl.store(y_ptr + cols, (x + tl.load(r_ptr + cols, mask=cols < K, other=0.0)).to(y_ptr.dtype.element_ty),
             mask=cols < K)  # fmt: skip


Config = tuple[int, int, int, int, bool]
EPS = 1e-5


def gemv(
    config: Config, prologue: int = NONE, residual: bool = False, pdl: int = 0, glu: bool = False,
    prefetch: int = PREFETCH, bits: bool = INT8_BITS,
) -> Callable[..., torch.Tensor]:  # fmt: skip
    """The package's GEMV kernel (flashrt_build/stages/triton_kernels.py) at `config`, with a prologue and a
    residual add; `pdl`: with its wait (step_ready's mode), launched as a programmatic dependent (the pdl pass's
    launch); `glu`: w's rows gate's then up's, SiLU(gate) * up out (half the rows a program, as gemv.py launches it);
    `prefetch`: the weight tiles it loads before the wait; `bits`: int8 rows widened through fp32's bits (else
    converted)."""
    block_n, block_k, warps, stages, evict = config
    launch = {"launch_pdl": True} if pdl else {}

    def call(w: torch.Tensor, x: torch.Tensor, v: torch.Tensor | None = None, r: torch.Tensor | None = None,
             s: torch.Tensor | None = None):  # fmt: skip
        """`s`: int8 rows' scales (w int8, as int8_wo's layers call it)."""
        (n, program_rows), k = launch_rows(w.shape[0], block_n, glu), w.shape[1]
        step = min(block_k, triton.next_power_of_2(k))
        y = torch.empty(n, device=w.device, dtype=x.dtype)
        flashrt_pdl_gemv[(triton.cdiv(n, program_rows),)](
            w, x, x if v is None else v, w, y if r is None else r, y, w if s is None else s, n, k, EPS,
            PROLOGUE=prologue, HAS_BIAS=False, HAS_RESIDUAL=residual, HAS_SCALE=s is not None, BLOCK_N=program_rows,
            BLOCK_K=step, EVICT=evict, PDL=pdl, GLU=glu, PREFETCH=prefetch,
            INT8_BITS=bits, num_warps=warps, num_stages=stages, **launch,
        )  # fmt: skip
        return y

    return call


def add_norm(x: torch.Tensor, r: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h, y = torch.empty_like(x), torch.empty_like(x)
    add_norm_kernel[(1,)](x, r, g, h, y, x.numel(), EPS, BLOCK=triton.next_power_of_2(x.numel()), num_warps=8)
    return h, y


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(g)
    silu_mul_kernel[(triton.cdiv(g.numel(), 1024),)](g, u, y, g.numel(), BLOCK=1024)
    return y


def add(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(x)
    add_kernel[(triton.cdiv(x.numel(), 1024),)](x, r, y, x.numel(), BLOCK=1024)
    return y


def rms_norm(h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """transformers' LlamaRMSNorm."""
    h32 = h.float()
    return g * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + EPS)).to(h.dtype)


# The fusions, each as (name, shape, the package's kernels today, fused, reference). The callables
# take (w, inputs), inputs = (x, r, g, gate, up, h) of the layer's sizes (`inputs`). Where a norm
# moves into the GEMV, its residual add moves into the previous GEMV's epilogue (the `o` row):
# today adds and normalizes x + r, the fused kernel normalizes h = x + r as that epilogue wrote it.
def fusions(config: Config) -> list[tuple[str, str, Callable, Callable, Callable]]:
    plain, norm, gated = gemv(config), gemv(config, NORM), gemv(config, GATED)
    residual, gated_residual = gemv(config, residual=True), gemv(config, GATED, residual=True)
    glu = gemv(config, NORM, glu=True)
    silu = torch.nn.functional.silu

    def glu_reference(w: torch.Tensor, i: tuple[torch.Tensor, ...]) -> torch.Tensor:
        gate, up = (w.float() @ rms_norm(i[5], i[2]).float()).chunk(2)
        return silu(gate) * up

    return [
        ("add + RMSNorm, then q/k/v", "qkv", lambda w, i: plain(w, add_norm(i[0], i[1], i[2])[1]),
         lambda w, i: norm(w, i[5], i[2]), lambda w, i: w.float() @ rms_norm(i[5], i[2]).float()),
        ("add + RMSNorm, then gate/up", "gate_up", lambda w, i: plain(w, add_norm(i[0], i[1], i[2])[1]),
         lambda w, i: norm(w, i[5], i[2]), lambda w, i: w.float() @ rms_norm(i[5], i[2]).float()),
        ("RMSNorm, gate/up, SiLU(gate) * up (GLU)", "gate_up", lambda w, i: silu_mul(*norm(w, i[5], i[2]).chunk(2)),
         lambda w, i: glu(w, i[5], i[2]), glu_reference),
        ("o, then the residual add", "o", lambda w, i: add(plain(w, i[0]), i[1][: w.shape[0]]),
         lambda w, i: residual(w, i[0], None, i[1][: w.shape[0]]),
         lambda w, i: w.float() @ i[0].float() + i[1][: w.shape[0]].float()),
        ("SiLU(gate) * up, then down", "down", lambda w, i: plain(w, silu_mul(i[3], i[4])),
         lambda w, i: gated(w, i[3], i[4]), lambda w, i: w.float() @ (silu(i[3].float()) * i[4].float())),
        ("SiLU(gate) * up, down, the residual add", "down",
         lambda w, i: add(plain(w, silu_mul(i[3], i[4])), i[1][: w.shape[0]]),
         lambda w, i: gated_residual(w, i[3], i[4], i[1][: w.shape[0]]),
         lambda w, i: w.float() @ (silu(i[3].float()) * i[4].float()) + i[1][: w.shape[0]].float()),
    ]  # fmt: skip


def inputs(k: int, mlp: int, device: str) -> tuple[torch.Tensor, ...]:
    """(x, r, g, gate, up, h): an activation, a residual, a norm weight of K; a gate and an up of
    the MLP's width; h = x + r."""
    make = lambda n, s=1.0: (torch.randn(n, device=device) * s).to(torch.bfloat16)  # noqa: E731
    x, r = make(k), make(k)
    return x, r, make(k, 0.1) + 1, make(mlp), make(mlp), x + r


CHECKED = [(2, 64, 4, 1, False), (4, 32, 2, 2, True), (1, 128, 4, 3, False)]  # small launches, K past a step


def check(device: str) -> None:
    """Every kernel and fusion against float references at small sizes (a CPU under TRITON_INTERPRET=1)."""
    torch.manual_seed(0)
    for config in CHECKED:
        for name, _, today, fused, reference in fusions(config):
            w = torch.randn(24, 96, device=device).to(torch.bfloat16)
            i = inputs(96, 96, device)
            expected = reference(w, i)
            for how, fn in (("today", today), ("fused", fused)):
                got = fn(w, i).float()
                error = ((got - expected).norm() / expected.norm()).item()
                if error > 1e-2:
                    raise SystemExit(f"{name} ({how}, {config}): relative error {error:.3g}")
        print(f"{config}: the fusions agree with their references", flush=True)
    # int8 rows and their scales (int8_wo's layers), widened through fp32's bits and converted
    every = torch.arange(-128, 128, device=device).to(torch.int8)[:, None].expand(256, 96).contiguous()
    one_hot, ones = torch.zeros(96, device=device, dtype=torch.bfloat16), torch.ones(256, 1, device=device)
    one_hot[37] = 1
    for config, bits in itertools.product(CHECKED, (True, False)):
        w = torch.randn(24, 96, device=device).to(torch.bfloat16)
        quantized, x = int8_rows("w", w), inputs(96, 96, device)[0]
        expected = (quantized["w"].float() * quantized["w_scale"]) @ x.float()
        got = gemv(config, bits=bits)(quantized["w"], x, s=quantized["w_scale"]).float()
        float_error = (gemv(config)(w, x).float() - w.float() @ x.float()).norm() / expected.norm()
        if (error := max(((got - expected).norm() / expected.norm()).item(), float_error.item())) > 1e-2:
            raise SystemExit(f"int8 rows or bf16 ({config}, bits {bits}): relative error {error:.3g}")
        # each of the 256 int8 values comes out exactly (a sum of zeros and itself)
        got = gemv(config, bits=bits)(every, one_hot, s=ones).float()
        if not torch.equal(got, every[:, 0].float()):
            raise SystemExit(f"int8 values ({config}, bits {bits}): {got.tolist()}")
    print("int8 rows agree with their reference, every int8 value exact", flush=True)


def configurations(sizes: dict[str, tuple[int, int, int]], configs: list[Config], replays: int):
    """Each shape's shipped and best configuration: (table rows, {shape: (best us, config)}, {shape: shipped us})."""
    rows, best, shipped = [], {}, {}
    for name, (n, k, _) in sizes.items():
        weights, x = streamed(n, k), torch.randn(k, device="cuda", dtype=torch.bfloat16)
        timed = {c: replayed_us(gemv(c), weights, replays, x) for c in configs}
        best[name], shipped[name] = min((us, c) for c, us in timed.items()), timed[SHIPPED]
        size, us = n * k * 2, best[name][0]
        rows.append([name, f"{n}x{k}", f"{shipped[name]:.2f}", f"{size / shipped[name] / 1e6:.2f}", f"{us:.2f}",
                     f"{size / us / 1e6:.2f}", str(best[name][1]), f"{us / shipped[name]:.3f}"])  # fmt: skip
        print(rows[-1], flush=True)
        del weights
    return rows, best, shipped


def fused_against_today(sizes: dict[str, tuple[int, int, int]], best: dict, replays: int) -> list[list[str]]:
    """Each fusion's kernels today against its one kernel, at the shipped configuration and the shape's best."""
    rows = []
    mlp = sizes["down"][1]
    for config_name, config in (("shipped", SHIPPED), ("best for the shape", None)):
        for index, (name, shape, *_) in enumerate(fusions(SHIPPED)):
            chosen = config or best[shape][1]
            _, _, today, fused, _ = fusions(chosen)[index]
            n, k, per_step = sizes[shape]
            weights, i = streamed(n, k), inputs(k, mlp, "cuda")
            a = replayed_us(today, weights, replays, i)
            b = replayed_us(fused, weights, replays, i)
            rows.append([name, config_name, str(chosen), f"{a:.2f}", f"{b:.2f}", f"{b / a:.3f}",
                         f"{(a - b) * per_step:.1f}"])  # fmt: skip
            print(rows[-1], flush=True)
            del weights
    return rows


def gemv_chain(weights: list[dict[str, torch.Tensor]], head: torch.Tensor | None, x: torch.Tensor,
               norm: torch.Tensor, pdl: int, config: Config = SHIPPED, glu: bool = True, prefetch: int = PREFETCH,
               bits: bool = INT8_BITS, head_config: Config = SHIPPED) -> torch.Tensor:  # fmt: skip
    """A decode step's GEMVs as the gemv_fusion pass calls them, each
    feeding the next (`glu=False`: as it called them before, SiLU(gate) * up
    computed by every program of `down`); the attention's output stands in
    for q's (its kernels are not probed). A layer's `<name>_scale` makes
    its weight int8 rows (int8_wo's layers); the lm_head stays bf16,
    launched at `head_config` (a package launches it at bf16's launch
    whatever the layers'), or is left out (None: the layers alone)."""
    normed, added = (
        gemv(config, NORM, pdl=pdl, prefetch=prefetch, bits=bits),
        gemv(config, residual=True, pdl=pdl, prefetch=prefetch, bits=bits),
    )
    gated = gemv(config, GATED, residual=True, pdl=pdl, prefetch=prefetch, bits=bits)
    glu_up = gemv(config, NORM, pdl=pdl, glu=True, prefetch=prefetch, bits=bits)
    h = x
    for w in weights:
        scale = {name: w.get(f"{name}_scale") for name in ("qkv", "o", "gate_up", "down")}
        qkv = normed(w["qkv"], h, norm, s=scale["qkv"])
        h = added(w["o"], qkv[: h.shape[0]], None, h, s=scale["o"])
        if glu:
            h = added(w["down"], glu_up(w["gate_up"], h, norm, s=scale["gate_up"]), None, h, s=scale["down"])
        else:
            gate_up = normed(w["gate_up"], h, norm, s=scale["gate_up"])
            half = gate_up.shape[0] // 2
            h = gated(w["down"], gate_up[:half], gate_up[half:], h, s=scale["down"])
    if head is None:
        return h
    return gemv(head_config, NORM, pdl=pdl, prefetch=prefetch, bits=bits)(head, h, norm)


def int8_rows(name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """`w` as int8_wo quantizes it: int8 rows and one fp32 scale a row (symmetric), under `name` and `<name>_scale`."""
    scale = w.float().abs().amax(1, keepdim=True).clamp(min=1e-12) / 127
    return {name: (w.float() / scale).round().clamp(-127, 127).to(torch.int8), f"{name}_scale": scale}


def chain_inputs(layers: int) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]], torch.Tensor,
                                       torch.Tensor, torch.Tensor]:  # fmt: skip
    """A decode step's GEMV chain's operands at Llama-3.2-1B's shapes: each
    layer's bf16 weights, the same as int8 rows and their scales, the
    lm_head, the norm's weights and the input x."""
    sizes = {name: (n, k) for name, n, k, _ in SHAPES}
    make = lambda *shape: torch.randn(*shape, device="cuda").to(torch.bfloat16) / shape[-1] ** 0.5  # noqa: E731
    weights = [{name: make(*sizes[name]) for name in ("qkv", "o", "gate_up", "down")} for _ in range(layers)]
    head, norm, x = make(*sizes["lm_head"]), torch.ones(sizes["o"][0], device="cuda").bfloat16(), make(sizes["o"][0])
    int8 = [{**w, **{k: v for name in w for k, v in int8_rows(name, w[name]).items()}} for w in weights]
    return weights, int8, head, norm, x


# int8 rows' launches to time beside the shipped one (which of them ships is timed once, as the shipped chain): one
# or two 16-byte loads a row a thread, more rows or warps a program
INT8_LAUNCHES = [(1, 1024, 4), (2, 512, 4), (2, 1024, 4), (1, 2048, 4), (2, 2048, 4), (2, 2048, 8), (4, 1024, 4),
                 (4, 2048, 4), (4, 2048, 8), (8, 1024, 8)]  # fmt: skip


def int8_launches(layers: int, replays: int) -> list[list[str]]:
    """The int8 chain (int8_wo's layers, the lm_head bf16 at bf16's launch,
    as a package launches it) at INT8_LAUNCHES, and the bf16 and int8
    chains without the lm_head: the layers' own pace, which the lm_head's
    bytes (a fifth of bf16's step, a third of int8's) blur. Table rows (ms
    a step, against bf16's chain with or without the lm_head alike)."""
    weights, int8, head, norm, x = chain_inputs(layers)
    chains = [("bf16", weights, SHIPPED, head), ("bf16", weights, SHIPPED, None), ("int8", int8, INT8_SHIPPED, head),
              ("int8", int8, INT8_SHIPPED, None)]  # fmt: skip
    chains += [("int8", int8, (*launch, STAGES, EVICT), lm_head) for launch in INT8_LAUNCHES
               if launch != INT8_LAUNCH for lm_head in (head, None)]  # fmt: skip
    rows, bf16 = [], {}
    for kind, chosen, config, lm_head in chains:
        run = functools.partial(gemv_chain, chosen, lm_head, x, norm, MODE, config)
        us = min(replayed_us(lambda _, run=run: run(), [head], replays) for _ in range(3))
        base = bf16.setdefault(lm_head is None, us)
        rows.append([kind, str(config[:3]), "no" if lm_head is None else "yes", f"{us / 1000:.4f}", f"{us / base:.3f}"])
        print(rows[-1], flush=True)
    return rows


def pdl_chain(layers: int, replays: int, configs: list[Config]) -> tuple[list[list[str]], bool]:
    """A decode step's GEMV chain (Llama-3.2-1B's shapes, the gemv_fusion
    pass's kernels) replayed from a CUDA graph, without and with PDL: as
    the pass calls them, as it did before (SiLU * up in down's prologue),
    and at `configs` (a larger K step loads more of the weights before the
    wait). Table rows (ms a step, ratio against the first, plain) and
    whether each chain gave the same bits with PDL as without (run eagerly,
    launched as in the graph)."""
    weights, int8, head, norm, x = chain_inputs(layers)

    modes = {
        0: "plain",
        WAIT_THEN_LAUNCH: "PDL: wait, then launch the next",
        LAUNCH_THEN_WAIT: "PDL: launch the next, then wait",
    }
    other = 3 - PREFETCH  # the tiles before the wait the kernel does not ship with (1 or 2)
    early = f", {other} K step{'s' if other > 1 else ''} loaded before the wait"
    plain = (PREFETCH, None)  # K tiles before the wait, int8 widening (None: bf16)
    chains = {(SHIPPED, True, *plain): "", (SHIPPED, False, *plain): ", SiLU * up in down (before)",
              (SHIPPED, True, other, None): early}  # fmt: skip
    chains |= {(config, True, *plain): "" for config in configs if config != SHIPPED}
    # int8_wo's layers (half the bytes a K step, so also steps of twice the K), widened through fp32's bits
    # as shipped (gemv.INT8_BITS), and at the shipped launch by the conversion instruction
    bits, converted = ", int8 rows (int8_wo)", ", int8 rows (int8_wo), converted"
    chains |= {(INT8_SHIPPED, True, PREFETCH, INT8_BITS): bits if INT8_BITS else converted,
               (INT8_SHIPPED, True, PREFETCH, not INT8_BITS): converted if INT8_BITS else bits}  # fmt: skip
    chains |= {(config, True, PREFETCH, INT8_BITS): bits for config in INT8_CONFIGS}
    # int8 rows take a register of fp32 sums for each byte they load: a second tile in flight costs few more
    chains[(INT8_SHIPPED, True, other, INT8_BITS)] = bits + early
    rows, outputs, base = [], [], 0.0
    for (config, glu, ahead, widen), how in chains.items():
        chosen, b = (weights, INT8_BITS) if widen is None else (int8, widen)
        head_config = config if widen is None else SHIPPED  # the bf16 lm_head of an int8 chain at bf16's launch
        for pdl, name in modes.items():
            outputs.append(gemv_chain(chosen, head, x, norm, pdl, config, glu, ahead, b, head_config))  # output kept
            run = functools.partial(gemv_chain, chosen, head, x, norm, pdl, config, glu, ahead, b, head_config)
            chain = lambda _, run=run: run()  # noqa: E731
            us = min(replayed_us(chain, [head], replays) for _ in range(3))
            base = base or us
            rows.append([f"{config}{how}", name, f"{us / 1000:.4f}", f"{us / base:.3f}"])
            print(rows[-1], flush=True)
    # another chain or K step sums in another order: the same bits are asked within a chain only
    step = len(modes)
    return rows, all(
        torch.equal(outputs[i], outputs[j]) for i in range(0, len(outputs), step) for j in range(i, i + step)
    )


def fused_configurations(sizes: dict[str, tuple[int, int, int]], configs: list[Config], replays: int):
    """Each fusion's one kernel at every configuration: the best against the shipped launch. More rows
    a program read x (and the prologue's operands) fewer times: each program reads all of them."""
    rows, mlp = [], sizes["down"][1]
    for index, (name, shape, *_) in enumerate(fusions(SHIPPED)):
        n, k, per_step = sizes[shape]
        weights, i = streamed(n, k), inputs(k, mlp, "cuda")
        timed = {c: replayed_us(fusions(c)[index][3], weights, replays, i) for c in dict.fromkeys([SHIPPED, *configs])}
        us, config = min((us, c) for c, us in timed.items())
        rows.append([name, f"{n}x{k}", f"{timed[SHIPPED]:.2f}", f"{us:.2f}", str(config), f"{us / timed[SHIPPED]:.3f}",
                     f"{(timed[SHIPPED] - us) * per_step:.1f}"])  # fmt: skip
        print(rows[-1], flush=True)
        del weights
    return rows


def config_list(text: str) -> list[Config]:
    """block_n:block_k:warps launches (one stage, evict-first, as shipped), comma-separated; "" none."""
    if not text:
        return []
    return [(*map(int, item.split(":")), 1, True) for item in text.split(",")]  # type: ignore[misc]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true", help="the kernels' numerics only (TRITON_INTERPRET=1: a CPU)")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--block-n", type=int_list, default=[1, 2, 4])
    parser.add_argument("--block-k", type=int_list, default=[1024, 2048])
    parser.add_argument("--warps", type=int_list, default=[4, 8])
    parser.add_argument("--stages", type=int_list, default=[1, 3])
    parser.add_argument("--pdl-only", action="store_true", help="only the GEMV chain without and with PDL")
    parser.add_argument("--layers", type=int, default=16, help="the chain's layers (Llama-3.2-1B: 16)")
    parser.add_argument(
        "--pdl-configs",
        type=config_list,
        default=config_list("2:2048:8,2:4096:8,2:8192:8"),
        help="launches the PDL chain tries beside the shipped one (block_n:block_k:warps)",
    )
    parser.add_argument("--fused-only", action="store_true", help="only the fused kernels' configurations")
    parser.add_argument("--int8-launches", action="store_true", help="only the int8 chain at launches, and no lm_head")
    args = parser.parse_args()
    if args.check:
        check("cpu" if not torch.cuda.is_available() else "cuda")
        return
    check("cuda")
    gpu = torch.cuda.get_device_name()
    tag = "h200" if "H200" in gpu else "h100" if "H100" in gpu else "gpu"
    sizes = {name: (n, k, per_step) for name, n, k, per_step in SHAPES}
    if args.fused_only:
        configs = list(itertools.product(args.block_n, args.block_k, args.warps, args.stages, [True]))
        fused = fused_configurations(sizes, configs, args.replays)
        body = f"{gpu}, torch {torch.__version__}, triton {triton.__version__}; {len(configs)} configurations "
        body += "(block_n, block_k, warps, stages, evict_first)\n\n" + table(
            ["fusion", "N x K", "shipped us", "best us", "best config", "best / shipped", "us saved a step"], fused,
            "lrrrlrr")  # fmt: skip
        publish(RESULTS / f"gemv_fused_configs_{tag}.md", "The fused GEMVs' configurations",
                "python bench/gemv_fusion_probe.py " + " ".join(sys.argv[1:]), body)  # fmt: skip
        return
    if args.int8_launches:
        rows = int8_launches(args.layers, 10 * args.replays)
        body = f"{gpu}, torch {torch.__version__}, triton {triton.__version__}; {args.layers} layers, "
        body += "the shipped PDL\n\n"
        body += table(["weights", "launch (block_n, block_k, warps)", "lm_head", "ms a step", "against bf16's"], rows,
                      "lllrr")  # fmt: skip
        publish(RESULTS / f"gemv_int8_launches_{tag}.md", "The GEMV chain on int8 rows at other launches",
                "python bench/gemv_fusion_probe.py " + " ".join(sys.argv[1:]), body)  # fmt: skip
        return
    chain, same = pdl_chain(args.layers, 10 * args.replays, args.pdl_configs)
    pdl_body = (
        f"{gpu}, torch {torch.__version__}, triton {triton.__version__}; {args.layers} layers, "
        f"{4 * args.layers + 1} GEMVs a step, the shipped launch {SHIPPED} (int8 rows: {INT8_SHIPPED}) "
        "(block_n, block_k, warps, stages, evict_first); "
        f"PDL gave {'the same bits as plain launches' if same else 'DIFFERENT OUTPUTS'}\n\n"
        + table(["launch", "GEMV chain", "ms a step", "against the shipped plain chain"], chain, "llrr")
    )
    if args.pdl_only:
        publish(RESULTS / f"gemv_pdl_probe_{tag}.md", "A decode step's GEMV chain with programmatic dependent launch",
                "python bench/gemv_fusion_probe.py " + " ".join(sys.argv[1:]), pdl_body)  # fmt: skip
        return
    configs = list(itertools.product(args.block_n, args.block_k, args.warps, args.stages, [False, True]))
    peak = {"H100": 3.35, "H200": 4.8}.get(next((g for g in ("H100", "H200") if g in gpu), ""), float("nan"))
    torch.manual_seed(0)
    rows, best, shipped = configurations(sizes, configs, args.replays)
    fused_rows = fused_against_today(sizes, best, args.replays)
    step_shipped = sum(us * sizes[s][2] for s, us in shipped.items()) / 1000
    step_best = sum(b[0] * sizes[s][2] for s, b in best.items()) / 1000
    step_gb = sum(n * k * 2 * per_step for n, k, per_step in sizes.values()) / 1e9
    body = (
        f"{gpu} (peak {peak} TB/s), torch {torch.__version__}, triton {triton.__version__}; "
        f"{len(configs)} configurations (block_n, block_k, warps, stages, evict_first)\n\n"
        + table(
            ["shape", "N x K", "shipped us", "TB/s", "best us", "TB/s", "best config", "best / shipped"],
            rows,
            "lrrrrrrlr",
        )  # fmt: skip
        + f"\nOne decode step's GEMVs: shipped {step_shipped:.3f} ms, best per shape {step_best:.3f} ms; "
        f"the floor of their {step_gb:.2f} GB: {step_gb / peak:.3f} ms\n\n"
        + "Fusions: the kernels the package runs today (the pointwise kernel, then the GEMV) against one kernel\n\n"
        + table(
            [
                "fusion",
                "GEMV config",
                "(block_n, block_k, warps, stages, evict)",
                "today us",
                "fused us",
                "fused / today",
                "us saved a step",
            ],
            fused_rows,
            "lllrrrr",
        )  # fmt: skip
        + "\nProgrammatic dependent launch: "
        + pdl_body
    )
    publish(RESULTS / f"gemv_fusion_probe_{tag}.md", "Decode GEMVs: configurations and fused neighbours",
            "python bench/gemv_fusion_probe.py " + " ".join(sys.argv[1:]), body)  # fmt: skip


if __name__ == "__main__":
    main()
