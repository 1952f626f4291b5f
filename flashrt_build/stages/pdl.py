"""The `pdl` pass: the package's own kernels (the GEMV, the decode
attention) launched as programmatic dependents of the kernel before them.

A decode step is a chain of short kernels, each of which waits for the one
before it to end before a single one of its programs starts, and each of
which then needs a microsecond or two to fill the GPU: a GEMV of a few MB
spends as long starting and ending as streaming. Hopper's programmatic
dependent launch (PDL) starts a kernel while the one before it finishes;
the kernel itself says where it needs that kernel's writes
(`griddepcontrol.wait`). The GEMV loads its first weight tile before it
waits (the weights do not depend on the step), so its reads begin under
the previous kernel's tail.

AOTInductor launches every kernel with a plain `cuLaunchKernel`; this pass
has the package's launcher launch the kernels whose names start with
`flashrt_pdl_` with the PDL attribute instead (`cuLaunchKernelEx`), at the
compile (`patched_launcher`). Only those kernels: each waits before it
reads or writes anything another kernel touches, which Inductor's own
kernels are not written to do. A CUDA graph keeps the launches' edges.
The launcher knows its kernels by name with `cuFuncGetName` (a CUDA 12.3
driver; every torch build for Hopper asks for a newer one).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
from collections.abc import Iterator
from typing import Any

import torch

from ..config.spec import BuildSpec

PREFIX = "flashrt_pdl_"  # a kernel whose name starts so waits before it touches another's data
# How the kernels of a package with the pass wait (triton_kernels.step_ready's PDL): 1 waits, then lets
# the next kernel launch; 2 lets it launch first, so its programs load their first weights sooner (each
# still waits for this kernel to end; it launches only once every program of this one has started).
# 2 ships: bench/gemv_fusion_probe.py --pdl-only times both on a step's GEMV chain (BENCHMARKS.md).
WAIT_THEN_LAUNCH, LAUNCH_THEN_WAIT = 1, 2
MODE = LAUNCH_THEN_WAIT

# AOTInductor's launch in its launcher source (torch/_inductor/codegen/cuda/device_op_overrides.py)
_LAUNCH = re.compile(
    r"CUDA_DRIVER_CHECK\(cuLaunchKernel\(\s*func, gridX, gridY, gridZ, (\d+)\*numWarps, 1, 1, "
    r"sharedMemBytes, stream, args, nullptr\s*\)\);"
)
_LAUNCHER = """
            // flashrt_build's pdl pass: a kernel named flashrt_pdl_* launches as a programmatic
            // dependent of the kernel before it (it waits on that kernel itself: griddepcontrol.wait)
            static inline void flashrtLaunch(
                    CUfunction func, uint32_t gridX, uint32_t gridY, uint32_t gridZ, uint32_t threads,
                    uint32_t sharedMemBytes, cudaStream_t stream, void* args[]) {
                const char* name = nullptr;
                if (cuFuncGetName(&name, func) == CUDA_SUCCESS && name != nullptr
                        && std::string(name).rfind("PREFIX", 0) == 0) {
                    CUlaunchAttribute attribute{};
                    attribute.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
                    attribute.value.programmaticStreamSerializationAllowed = 1;
                    CUlaunchConfig config{};
                    config.gridDimX = gridX;
                    config.gridDimY = gridY;
                    config.gridDimZ = gridZ;
                    config.blockDimX = threads;
                    config.blockDimY = 1;
                    config.blockDimZ = 1;
                    config.sharedMemBytes = sharedMemBytes;
                    config.hStream = stream;
                    config.attrs = &attribute;
                    config.numAttrs = 1;
                    CUDA_DRIVER_CHECK(cuLaunchKernelEx(&config, func, args, nullptr));
                    return;
                }
                CUDA_DRIVER_CHECK(cuLaunchKernel(
                    func, gridX, gridY, gridZ, threads, 1, 1, sharedMemBytes, stream, args, nullptr
                ));
            }
""".replace("PREFIX", PREFIX)


_launching = False  # inside patched_launcher(): the compile of a package the pass launches


def pdl_kernels(x: torch.Tensor) -> int:
    """The PDL instructions a kernel for `x`'s device, launched now, carries
    (its PDL argument; 0: none): only in the compile of a package whose
    launcher launches it so (a package without the pass runs the kernels it
    always had), on a Hopper or later GPU (older ones lack them), not in
    Triton's interpreter."""
    if not _launching or x.device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return 0
    return MODE if torch.cuda.get_device_capability(x.device)[0] >= 9 else 0


def unavailable(spec: BuildSpec) -> str | None:
    """Why a build cannot launch its own kernels as programmatic
    dependents; None where it can (the passes stage says it, the compile
    stage acts on it)."""
    device = spec.device
    if not device.startswith("cuda"):
        return f"target.device={device}"
    if not (spec.gemv or spec.decode_attention):
        return "no kernel of its own to launch: passes.gemv=false, passes.decode_attention=false"
    if not torch.cuda.is_available():
        return "no CUDA device to build on"
    major, minor = torch.cuda.get_device_capability(torch.device(device))
    if major < 9:
        return f"{torch.cuda.get_device_name(torch.device(device))} (sm_{major}{minor}) is older than Hopper"
    if not launcher_known():
        return f"torch {torch.__version__}'s AOTInductor launcher is not one the pass knows"
    return None


def with_pdl_launch(source: str) -> str | None:
    """AOTInductor's launcher source with the PDL launch for flashrt_pdl_*
    kernels; None where the source is not the one this pass knows."""
    launch = _LAUNCH.search(source)
    start = source.find("static inline void launchKernel(")
    if launch is None or start < 0:
        return None
    threads = f"{launch.group(1)}*numWarps"
    call = f"flashrtLaunch(func, gridX, gridY, gridZ, {threads}, sharedMemBytes, stream, args);"
    patched = source[: launch.start()] + call + source[launch.end() :]
    return patched[:start] + _LAUNCHER.strip() + "\n\n            " + patched[start:]


@functools.cache
def launcher_known() -> bool:
    """Whether this torch's AOTInductor launcher is one the pass can patch."""
    return with_pdl_launch(_overrides().kernel_driver()) is not None


def _overrides() -> Any:
    from torch._inductor.codegen.cuda.device_op_overrides import CUDADeviceOpOverrides

    return CUDADeviceOpOverrides()


@contextlib.contextmanager
def patched_launcher() -> Iterator[None]:
    """AOTInductor's CUDA launcher with the PDL launch while compiling, and
    the kernels with their PDL instructions (`pdl_kernels`)."""
    from torch._inductor.codegen.cuda.device_op_overrides import CUDADeviceOpOverrides

    global _launching
    original, _launching = CUDADeviceOpOverrides.kernel_driver, True

    def kernel_driver(self: Any) -> str:
        source = original(self)
        return with_pdl_launch(source) or source

    CUDADeviceOpOverrides.kernel_driver = kernel_driver  # type: ignore[method-assign]
    try:
        yield
    finally:
        CUDADeviceOpOverrides.kernel_driver = original  # type: ignore[method-assign]
        _launching = False
