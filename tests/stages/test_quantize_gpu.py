"""Quantized packages on a GPU (marked `gpu`: skipped without one; run on the
lent H200): each shipped recipe builds tiny_lm in bf16 with external weights,
verifies against the quantized and the float module, and serves from CUDA
graphs with the tokens of a trained model unchanged. The recipes' logic is
covered on the CPU in test_quantize.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from greedy import eager_greedy, train_on_a_cycle
from safetensors.torch import save_file

import flashrt_build
from flashrt_build.config.compose import compose
from flashrt_build.config.spec import resolve_spec
from flashrt_build.stages.module import instantiate_module

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

# Linear widths int4's tinygemm takes (multiples of its group size and tile)
LM = ["+module=tiny_lm", "target=cuda", "module.model.dim=256", "module.model.heads=4"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    module = instantiate_module(resolve_spec(compose([*LM, "target.dtype=float32"])))
    train_on_a_cycle(module)
    path = tmp_path_factory.mktemp("trained") / "model.safetensors"
    save_file({name: t.detach().cpu().contiguous() for name, t in module.state_dict().items()}, path)
    return path


@pytest.mark.parametrize("recipe", ["int8_wo", "int8_dq_prefill", "int4_wo", "fp8"])
def test_each_recipe_builds_verifies_and_keeps_a_trained_models_tokens(
    recipe: str, trained: Path, tmp_path: Path
) -> None:
    overrides = [*LM, f"quant={recipe}", "weights=external", f"module.checkpoint={trained}", "serve.cuda_graphs=true"]
    built = flashrt_build.build(compose([*overrides, f"output_dir={tmp_path / 'out'}", f"output_root={tmp_path}"]))
    manifest = built.manifest
    quantization = manifest["verification"]["quantization"]
    assert manifest["verification"]["passed"] and quantization["passed"]
    assert quantization["max_rel_err"] <= manifest["config"]["quant"]["max_rel_error"]
    assert any(t.get("quantized") for t in manifest["weights"]["tensors"])
    prompt = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(3)).cuda()
    float_lm = instantiate_module(resolve_spec(compose([*LM, f"module.checkpoint={trained}"])))
    expected = eager_greedy(float_lm, prompt, 32)
    assert torch.equal(flashrt_build.generate(flashrt_build.load(built.output_dir), prompt, 32).tokens, expected)
