"""The decode_attention kernel alone at Llama-3.2-1B's attention shape (32
heads over 8 KV heads, 64 wide, a 1024-position cache, half of it filled):
compiled into an AOTInductor package (the way a build compiles it; its
error in full where it fails) and timed against SDPA with the cache copied
per head, as transformers runs it. Both ways the kernel can run: split and
merge (two kernels, as shipped), and one kernel whose last program of each
KV head merges (`counts`, a buffer the package writes in place: the
package's kernels a call are counted, a copy of the buffer would show).

    CXX=g++-12 python3 bench/decode_attention_probe.py
"""

from __future__ import annotations

import sys
import tempfile
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from serve_llm import profile_step  # noqa: E402

from flashrt_build.stages.decode_attention import decode_attention_op  # noqa: E402


class Attend(torch.nn.Module):
    def __init__(self, one_kernel: bool = False) -> None:
        super().__init__()
        self.one_kernel = one_kernel
        self.register_buffer("counts", torch.zeros(64, dtype=torch.int32))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        counts = self.counts if self.one_kernel else None
        return decode_attention_op()(q, k, v, mask[:, 0, 0, :], 0.125, None, None, counts)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125).transpose(1, 2)


def timed(fn, *args) -> float:  # noqa: ANN001
    graph = torch.cuda.CUDAGraph()
    fn(*args)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        for _ in range(20):
            fn(*args)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 400 * 1000  # us a call


def main() -> None:
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(1, 1, 32, 64, device=dev, dtype=dt).transpose(1, 2)
    k, v = (torch.randn(1, 8, 1024, 64, device=dev, dtype=dt) for _ in range(2))
    mask = torch.zeros(1, 1, 1, 1024, device=dev, dtype=torch.bool)
    mask[..., :513] = True
    args = (q, k, v, mask)
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for one_kernel in (False, True):
        how = "one kernel" if one_kernel else "split + merge"
        module = Attend(one_kernel).to(dev)
        eager = module(*args)
        print(how, "eager kernel vs sdpa max diff", (eager.float() - sdpa(*args).float()).abs().max().item())
        try:
            program = torch.export.export(module, args)
            with tempfile.TemporaryDirectory() as tmp:
                path = torch._inductor.aoti_compile_and_package(program, package_path=f"{tmp}/a.pt2")
                loaded = torch._inductor.aoti_load_package(path)
                print(how, "package vs eager max diff", (loaded(*args).float() - eager.float()).abs().max().item())
                profile = profile_step(lambda: loaded(*args), torch.device(dev))  # noqa: B023 - called here
                assert profile is not None  # a CUDA device
                names = ", ".join(f"{name} x{launches}" for name, launches, _ in profile["top"])
                print(how, f"package: {profile['kernels']} kernels a call ({names}), {timed(loaded, *args):.2f} us")
        except Exception:  # noqa: BLE001 - the whole error is the point
            traceback.print_exc()
        print(how, f"eager kernel {timed(module, *args):.2f} us")
    print(f"sdpa with per-head copies {timed(sdpa, *args):.2f} us")


if __name__ == "__main__":
    main()
