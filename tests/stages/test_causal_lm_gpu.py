"""A transformers Llama served from CUDA graphs on a GPU (marked `gpu`:
skipped without one; run on the lent H200): trained in the test until its
next token is decided (a random model's bf16 logits are near-ties that one
rounding flips), saved with save_pretrained in bf16, built with the shipped
causal_lm config, its greedy tokens from replayed graphs equal to
transformers' own bf16 eager `generate` for 64 tokens, from Python and C++."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import flashrt_build
from flashrt_build.artifact import PACKAGE
from flashrt_build.config.compose import compose
from flashrt_build.stages import pdl

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def train_llama_on_a_cycle(directory: Path, steps: int = 300, batch: int = 8, seed: int = 0) -> torch.Tensor:
    """A 2-layer Llama trained (float32, on the GPU) on `next = cycle[token]`, saved in bf16.
    Eight walks a step at lr 1e-3: one walk at 3e-3 diverged midway and left a
    model that follows the cycle a fifth of the time (transformers 5.24)."""
    import transformers

    generator = torch.Generator().manual_seed(seed)
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).cuda().train()
    cycle = torch.randperm(256, generator=generator)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(steps):
        tokens = [torch.randint(0, 256, (batch,), generator=generator)]
        for _ in range(127):
            tokens.append(cycle[tokens[-1]])
        sequence = torch.stack(tokens, dim=1).cuda()
        loss = model(sequence, labels=sequence).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval().to(torch.bfloat16).save_pretrained(directory)
    return cycle


@pytest.fixture(scope="module")
def trained_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[flashrt_build.BuildResult, Path, torch.Tensor]:
    root = tmp_path_factory.mktemp("llama_gpu")
    cycle = train_llama_on_a_cycle(root / "llama")
    result = flashrt_build.build(
        compose(
            [
                "+module=causal_lm",
                f"module.pretrained={root / 'llama'}",
                "module.max_cache_len=128",
                "module.max_prompt=64",
                "target=cuda",
                "weights=external",
                "serve.cuda_graphs=true",
                f"output_root={root / 'out'}",
            ]
        )  # fmt: skip
    )
    return result, root / "llama", cycle


def transformers_bf16_tokens(directory: Path, prompt: torch.Tensor, new: int) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():
        out = model.generate(prompt, do_sample=False, max_new_tokens=new, min_new_tokens=new, eos_token_id=None)
    return out[:, prompt.shape[1] :]


def test_replayed_greedy_tokens_equal_transformers_bf16_eager(
    trained_llama: tuple[flashrt_build.BuildResult, Path, torch.Tensor],
) -> None:
    result, directory, cycle = trained_llama
    assert result.manifest["target"]["dtype"] == "bfloat16" and result.manifest["verification"]["passed"]
    model = flashrt_build.load(result.output_dir)
    assert model.cuda_graphs
    prompt = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1)).cuda()
    tokens = flashrt_build.generate(model, prompt, 64).tokens
    assert torch.equal(tokens[0, 1:].cpu(), cycle[tokens[0, :-1].cpu()])  # decided tokens: the rule it learned
    assert torch.equal(tokens, transformers_bf16_tokens(directory, prompt, 64))
    assert cpp_tokens(result.output_dir, prompt, 64) == tokens[0].tolist()


def cpp_tokens(out: Path, prompt: torch.Tensor, new: int) -> list[int]:
    """Greedy tokens from flashrt-generate (C++, replayed graphs): the package without Python."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from cpp_runner import build_bench_tool

    ids = ",".join(map(str, prompt[0].tolist()))
    done = subprocess.run(
        [build_bench_tool("flashrt-generate"), out, "--prompt", ids, "--tokens", str(new), "--cuda-graphs", "--json"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)["tokens"]


def test_the_llm_passes_on_a_gpu_give_the_same_tokens(
    trained_llama: tuple[flashrt_build.BuildResult, Path, torch.Tensor],
) -> None:
    """Fused projections, grouped attention (its CUDA kernels under a mask,
    prefill's), the Triton GEMV of the decode step's matmuls with their norms,
    gates and residual adds, its Triton attention, launched as programmatic
    dependents on a Hopper GPU, and combo kernels, which
    the CPU tests cannot reach: verified
    and greedy as transformers, from Python and C++."""
    result, directory, _ = trained_llama
    passes = flashrt_build.build(
        compose(
            [
                "+module=causal_lm",
                f"module.pretrained={directory}",
                "module.max_cache_len=128",
                "module.max_prompt=64",
                "target=cuda",
                "weights=external",
                "serve.cuda_graphs=true",
                f"output_root={result.output_dir.parents[1]}",
                "passes=llm",  # with gemv, gemv_fusion, decode_attention, combo_kernels and pdl
                "passes.grouped_attention=true",
                "passes.rotary_fusion=true",  # off in llm: no kernel fewer on an H200
            ]
        )  # fmt: skip
    )
    assert passes.manifest["verification"]["passed"] and passes.manifest["passes"]["grouped_attention"]["models"] == 1
    # per layer the fused q/k/v, o, the fused gate/up and down; then the lm_head
    assert passes.manifest["passes"]["gemv"] == {"layers": 2 * 4 + 1, "int8_layers": 0}
    fused = {"norms": 2 * 2 + 1, "gates": 2, "residuals": 2 * 2}  # the llama family's 2 layers and its final norm
    assert passes.manifest["passes"]["gemv_fusion"] == {"methods": {"decode": fused}}
    # the second layer's attention takes the first's mask: one kernel computes it, not one a layer
    assert passes.manifest["passes"]["decode_attention"] == {"models": 1, "methods": {"decode": {"masks_shared": 1}}}
    assert passes.manifest["passes"]["rotary_fusion"] == {"methods": {"decode": {"queries": 2}}}
    assert passes.manifest["passes"]["combo_kernels"] == {"methods": ["decode"]}
    assert passes.manifest["methods"]["decode"]["inductor_options"]["combo_kernels"] is True
    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert passes.manifest["passes"]["pdl"] == {"launched": hopper}
    with zipfile.ZipFile(passes.output_dir / PACKAGE) as package:  # the launcher compiled into the package's .so
        library = b"".join(package.read(name) for name in package.namelist() if name.endswith(".so"))
    assert (b"cuLaunchKernelEx" in library and pdl.PREFIX.encode() in library) is hopper
    prompt = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(2)).cuda()
    tokens = flashrt_build.generate(flashrt_build.load(passes.output_dir), prompt, 64).tokens
    assert torch.equal(tokens, transformers_bf16_tokens(directory, prompt, 64))
    assert cpp_tokens(passes.output_dir, prompt, 64) == tokens[0].tolist()  # the Triton kernels run from C++ too
