"""The pdl pass: the package's launcher launches the flashrt_pdl_* kernels as
programmatic dependents, and those kernels wait before they touch what
another kernel wrote. The launcher's source is checked here as this torch
makes it, and compiled (syntax only) against the CUDA headers Triton ships;
the kernels as Triton compiles them for a Hopper GPU (PTX, no GPU needed)
and as torch's mutation analysis reads them. The GPU half (a package built
with it verifies and decodes, from Python and C++) is the passes test in
test_causal_lm_gpu.py."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from flashrt_build.stages import pdl
from flashrt_build.stages.gemv import NORM

triton = pytest.importorskip("triton")
kernels = pytest.importorskip("flashrt_build.stages.triton_kernels")


def driver_source() -> str:
    from torch._inductor.codegen.cuda.device_op_overrides import CUDADeviceOpOverrides

    return CUDADeviceOpOverrides().kernel_driver()


def test_the_patched_launcher_launches_flashrt_kernels_as_dependents_and_the_rest_as_before() -> None:
    source = driver_source()
    patched = pdl.with_pdl_launch(source)
    assert pdl.launcher_known() and patched is not None
    launch = patched[patched.index("static inline void launchKernel(") :]
    launch = launch[: launch.index("}") + 1]
    call = "flashrtLaunch(func, gridX, gridY, gridZ, 32*numWarps, sharedMemBytes, stream, args);"
    assert call in launch
    assert "cuLaunchKernel(" not in launch  # every launch goes through flashrtLaunch
    helper = patched[patched.index("// flashrt_build") : patched.index("static inline void launchKernel(")]
    assert f'std::string(name).rfind("{pdl.PREFIX}", 0) == 0' in helper  # only the kernels named so
    assert "CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION" in helper and "cuLaunchKernelEx(&config" in helper
    assert helper.count("cuLaunchKernel(") == 1  # any other kernel: the plain launch it had
    # everything else (loadKernel, the error checks) as torch wrote it
    assert patched.replace(helper, "").replace(call, pdl._LAUNCH.search(source).group(0)) == source


def test_the_patched_launcher_compiles_against_the_cuda_driver_api(tmp_path: Path) -> None:
    """The launcher as a package's wrapper holds it, compiled (syntax only)
    against Triton's copy of CUDA's headers: cuLaunchKernelEx, its config
    and attribute, cuFuncGetName as the driver API declares them."""
    include = Path(triton.__file__).parent / "backends" / "nvidia" / "include"
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None or not (include / "cuda.h").is_file():
        pytest.skip("needs a C++ compiler and Triton's CUDA headers")
    headers = ("cuda.h", "cuda_runtime_api.h", "filesystem", "optional", "stdexcept", "string", "vector")
    source = tmp_path / "launcher.cpp"
    source.write_text("".join(f"#include <{h}>\n" for h in headers) + pdl.with_pdl_launch(driver_source()))
    done = subprocess.run([compiler, "-std=c++17", "-fsyntax-only", f"-I{include}", str(source)],
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


def test_an_unknown_launcher_is_left_alone_and_the_patch_lasts_only_the_compile() -> None:
    source = driver_source()
    assert pdl.with_pdl_launch(source.replace("cuLaunchKernel(", "cuLaunchKernelV2(")) is None
    from torch._inductor.codegen.cuda.device_op_overrides import CUDADeviceOpOverrides

    with pdl.patched_launcher():
        assert CUDADeviceOpOverrides().kernel_driver() == pdl.with_pdl_launch(source)
        assert pdl._launching  # the kernels compiled now carry their waits (on a Hopper GPU)
    assert driver_source() == source and not pdl._launching


def ptx(fn: Any, types: dict[str, str], constexprs: dict[str, Any], warps: int = 4) -> list[str]:
    """`fn` compiled by Triton for an H100 (sm_90), its PTX's instruction lines."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {name: types.get(name, "constexpr") for name in fn.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name in types}
    where = {(fn.arg_names.index(name),): value for name, value in constexprs.items()}
    source = ASTSource(fn=fn, signature=signature, constexprs=where, attrs=aligned)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 1})
    assert compiled.metadata.name.startswith(pdl.PREFIX)  # the launcher picks the kernel by it
    return [line.strip() for line in compiled.asm["ptx"].splitlines()]


def before_the_wait(lines: list[str]) -> list[str]:
    waits = [i for i, line in enumerate(lines) if "griddepcontrol.wait" in line]
    assert waits, "no griddepcontrol.wait"
    return lines[: waits[0]]


GEMV_TYPES = {name: "*bf16" for name in ("w_ptr", "x_ptr", "v_ptr", "b_ptr", "r_ptr", "y_ptr")} | {"s_ptr": "*fp32"}
GEMV = dict(PROLOGUE=NORM, HAS_BIAS=True, HAS_RESIDUAL=True, HAS_SCALE=False, BLOCK_N=2, BLOCK_K=1024, EVICT=True,
            GLU=False, PREFETCH=1, INT8_BITS=True)  # fmt: skip


@pytest.mark.parametrize(("mode", "glu"), [(pdl.WAIT_THEN_LAUNCH, False), (pdl.LAUNCH_THEN_WAIT, False),
                                           (pdl.LAUNCH_THEN_WAIT, True)])  # fmt: skip
def test_the_gemv_loads_its_first_weights_then_waits_before_anything_the_step_wrote(mode: int, glu: bool) -> None:
    types = {**GEMV_TYPES, "N": "i32", "K": "i32", "eps": "fp32"}
    lines = ptx(kernels.flashrt_pdl_gemv, types, {**GEMV, "PDL": mode, "GLU": glu})
    early = [line for line in before_the_wait(lines) if "ld.global" in line or "st.global" in line]
    assert early and all("ld.global.L1::evict_first" in line for line in early)  # the weight's tile, nothing else
    if glu:  # gate's tile and up's, two row streams a program
        plain = ptx(kernels.flashrt_pdl_gemv, types, {**GEMV, "PDL": mode, "GLU": False})
        assert len(early) == 2 * len([line for line in before_the_wait(plain) if "ld.global" in line])
    # two tiles before the wait where asked (gemv.PREFETCH: the probe times it), the same loads after it
    ahead = ptx(kernels.flashrt_pdl_gemv, types, {**GEMV, "PDL": mode, "GLU": glu, "PREFETCH": 2})
    early_ahead = [line for line in before_the_wait(ahead) if "ld.global" in line or "st.global" in line]
    assert len(early_ahead) == 2 * len(early) and all("ld.global.L1::evict_first" in line for line in early_ahead)
    # int8 rows (int8_wo's layers): their tile alone before the wait too, the scales read after it
    int8_rows = {**GEMV, "HAS_SCALE": True, "PDL": mode, "GLU": glu}
    int8 = ptx(kernels.flashrt_pdl_gemv, {**types, "w_ptr": "*i8"}, int8_rows)
    early_int8 = [line for line in before_the_wait(int8) if "ld.global" in line or "st.global" in line]
    assert early_int8 and all("ld.global.L1::evict_first" in line for line in early_int8)
    (asm,) = [line for line in lines if "griddepcontrol" in line]  # one instruction each, in one asm statement
    assert asm.count("griddepcontrol.launch_dependents") == asm.count("griddepcontrol.wait") == 1
    # the next kernel may launch before this one waits (as shipped), or once it waited (the probe's other mode)
    waited_first = asm.index("griddepcontrol.wait") < asm.index("griddepcontrol.launch_dependents")
    assert waited_first == (mode == pdl.WAIT_THEN_LAUNCH)
    assert not any("griddepcontrol" in line for line in ptx(kernels.flashrt_pdl_gemv, types, {**GEMV, "PDL": 0}))
    assert pdl.MODE == pdl.LAUNCH_THEN_WAIT  # what a package compiles in: the faster chain on an H100 and an H200


@pytest.mark.parametrize("which", ["split", "split merging", "merge"])
def test_the_attention_kernels_wait_before_they_read_or_write(which: str) -> None:
    shape = dict(KV_HEADS=8, GROUPS=4, G_PAD=16, D=64, D_PAD=64, SPLITS=16, S_PAD=16, PDL=True)
    if which.startswith("split"):  # merging: the last program of a pair merges (its count and out after the wait)
        strides = ("sq_b", "sq_h", "sk_b", "sk_h", "sk_l", "sv_b", "sv_h", "sv_l", "sm_b", "sm_l")
        types = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "mask_ptr": "*i1", "cos_ptr": "*bf16",
                 "sin_ptr": "*bf16", "part_ptr": "*fp32", "stats_ptr": "*fp32", "count_ptr": "*i32",
                 "out_ptr": "*bf16", "length": "i32", "scale": "fp32",
                 **dict.fromkeys((*strides, "sc_b", "ss_b", "so_b", "so_h"), "i32")}  # fmt: skip
        constants = {**shape, "CHUNK": 64, "BLOCK_L": 64, "HAS_MASK": True, "ROTARY": True, "MERGE": "merging" in which}
        lines = ptx(kernels.flashrt_pdl_attention_split, types, constants)
        assert ("atom.global" in "\n".join(lines)) == ("merging" in which)
    else:
        types = {"part_ptr": "*fp32", "stats_ptr": "*fp32", "out_ptr": "*bf16", "so_b": "i32", "so_h": "i32"}
        lines = ptx(kernels.flashrt_pdl_attention_merge, types, shape)
    assert not [line for line in before_the_wait(lines) if "ld.global" in line or "st.global" in line or "atom" in line]


class HopperTarget:
    """Triton's active driver as torch's analysis asks it, on a machine without a GPU: an H100's target."""

    def get_current_target(self) -> Any:
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


def written(fn: Any, kwargs: dict[str, Any]) -> list[str]:
    """The arguments torch's mutation analysis (the one export and AOTInductor
    run on a Triton kernel) finds `fn` writes, its TTIR made for an H100."""
    from unittest import mock

    from torch._higher_order_ops import triton_kernel_wrap

    driver = type(triton.runtime.driver)
    with mock.patch.object(driver, "active", property(lambda _: HopperTarget()), create=True):
        accessed = triton_kernel_wrap.identify_accessed_tensors(fn, kwargs, {})
    return sorted(dep.name for dep in accessed.read_writes.writes)


def test_torchs_mutation_analysis_reads_what_each_waiting_kernel_writes() -> None:
    """An impure wait (Triton's own gdc_wait) makes the analysis give up and
    take every input for written: the first H100 build failed on it. The
    kernels' pure wait leaves their writes exactly their outputs."""
    import torch

    def bf16(*shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=torch.bfloat16)

    def fp32(*shape: int) -> torch.Tensor:
        return torch.zeros(*shape)

    shape = dict(KV_HEADS=1, GROUPS=4, G_PAD=16, D=64, D_PAD=64, SPLITS=1, PDL=True)
    strides = dict.fromkeys(("sq_b", "sk_b", "sv_b", "sm_b", "sc_b", "ss_b", "sm_l"), 1)
    strides |= dict.fromkeys(("sq_h", "sk_h", "sk_l", "sv_h", "sv_l"), 64)
    gemv = dict(w_ptr=bf16(8, 16), x_ptr=bf16(16), v_ptr=bf16(16), b_ptr=bf16(8), r_ptr=bf16(8), y_ptr=bf16(8),
                s_ptr=fp32(8), N=8, K=16, eps=1e-5, **{**GEMV, "BLOCK_K": 16}, PDL=True)  # fmt: skip
    split = dict(q_ptr=bf16(4, 64), k_ptr=bf16(64, 64), v_ptr=bf16(64, 64), mask_ptr=torch.ones(64, dtype=torch.bool),
                 cos_ptr=bf16(64), sin_ptr=bf16(64), part_ptr=fp32(16, 64), stats_ptr=fp32(32),
                 count_ptr=torch.zeros(1, dtype=torch.int32), out_ptr=bf16(4, 64), length=64, scale=0.125, so_b=1,
                 so_h=64, **strides, **shape, CHUNK=64, BLOCK_L=64, HAS_MASK=True, ROTARY=True, MERGE=False,
                 S_PAD=1)  # fmt: skip
    merge = dict(part_ptr=fp32(16, 64), stats_ptr=fp32(32), out_ptr=bf16(4, 64), so_b=1, so_h=64, **shape, S_PAD=1)
    assert written(kernels.flashrt_pdl_gemv, gemv) == ["y_ptr"]
    assert written(kernels.flashrt_pdl_gemv, {**gemv, "w_ptr": bf16(16, 16), "GLU": True}) == ["y_ptr"]
    int8 = {"w_ptr": torch.zeros(8, 16, dtype=torch.int8), "HAS_SCALE": True}  # int8_wo's rows: the scales only read
    assert written(kernels.flashrt_pdl_gemv, {**gemv, **int8}) == ["y_ptr"]
    assert written(kernels.flashrt_pdl_attention_split, split) == ["part_ptr", "stats_ptr"]
    # one kernel: its last program of a pair counts, merges into out
    merging = written(kernels.flashrt_pdl_attention_split, {**split, "MERGE": True})
    assert sorted(merging) == ["count_ptr", "out_ptr", "part_ptr", "stats_ptr"]
    assert written(kernels.flashrt_pdl_attention_merge, merge) == ["out_ptr"]


@pytest.mark.parametrize("name", ["flashrt_pdl_gemv", "flashrt_pdl_attention_split", "flashrt_pdl_attention_merge"])
def test_the_source_aotinductor_compiles_into_a_package_holds_the_kernels_one_wait(name: str) -> None:
    """AOTInductor compiles a user kernel's source with the module-level
    @triton.jit functions it calls: each kernel carries step_ready, whose
    wait is written once (triton_kernels.py)."""
    from torch._inductor.codegen.wrapper import user_defined_triton_kernel_transitive_closure_source_code

    source = user_defined_triton_kernel_transitive_closure_source_code(getattr(kernels, name))
    assert "def step_ready(PDL" in source and f"def {name}(" in source
    assert source.count("def step_ready(") == 1 and "step_ready(PDL)" in source
    if name == "flashrt_pdl_attention_split":  # the helpers' helpers too: merge_if_last calls merged_head
        assert "def merge_if_last(" in source and "def merged_head(" in source
