"""Custom operators in the graph, found before the compile: a Python-only
one is decomposed when its implementation traces, or refused naming it; one
with a C++ kernel stays, its library recorded and loaded before the package."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from clitools import module_conf

import flashrt_build
from flashrt_build.config.compose import compose
from flashrt_build.errors import ExportError

pytestmark = pytest.mark.slow


def build(tmp_path: Path, name: str, body: str) -> flashrt_build.BuildResult:
    conf = module_conf(tmp_path, name, body)
    return flashrt_build.build(compose([f"+module={name}", f"output_root={tmp_path / 'out'}"], config_dir=conf))


def test_a_python_only_operator_that_traces_is_decomposed(tmp_path: Path) -> None:
    result = build(tmp_path, "twice", "name: twice\nmodel: {_target_: modules.CallsCustomOps}\n"
                                      "inputs: {x: {shape: [3, 4]}}\n")  # fmt: skip
    assert result.manifest["verification"]["passed"] is True and "libraries" not in result.manifest
    # the package runs where the operator was never defined (tests/modules.py never imported): it calls none
    code = (
        "import sys, torch, flashrt_build\n"
        f"print(flashrt_build.load({str(result.output_dir)!r})(torch.ones(3, 4)).sum().item())\n"
        "assert 'modules' not in sys.modules\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    served = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert served.returncode == 0, served.stderr[-3000:]
    assert float(served.stdout) == pytest.approx(flashrt_build.load(result.output_dir)(torch.ones(3, 4)).sum().item())


def test_a_python_only_operator_that_does_not_trace_stops_the_build_before_the_compile(tmp_path: Path) -> None:
    with pytest.raises(ExportError) as info:
        build(tmp_path, "rows", "name: rows\nmodel: {_target_: modules.CallsCustomOps, op: nonzero_rows}\n"
                                "inputs: {x: {shape: [3, 4]}}\n")  # fmt: skip
    said = str(info.value)
    assert "calls flashrt_tests::nonzero_rows, a custom operator with only a Python implementation" in said
    assert "give it a C++ kernel" in said
    assert not (tmp_path / "out" / "rows").exists()


def test_an_operator_with_a_cpp_kernel_stays_and_its_library_is_loaded_first(
    roi_align_build: flashrt_build.BuildResult,
) -> None:
    import torchvision

    (library,) = roi_align_build.manifest["libraries"]
    assert library["ops"] == ["torchvision::roi_align"]
    assert Path(library["path"]).parent == Path(torchvision.__file__).parent
    # a serving process that never imports torchvision: load() registers the operator first
    code = (
        "import sys, torch, flashrt_build\n"
        f"model = flashrt_build.load({str(roi_align_build.output_dir)!r})\n"
        "torch.manual_seed(0)\n"
        "boxes = torch.tensor([[0., 0., 4., 4.], [2., 2., 7., 7.]])\n"
        "print(model(images=torch.randn(1, 3, 8, 8), boxes=boxes).sum().item())\n"
        "assert 'torchvision' not in sys.modules\n"
    )
    served = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert served.returncode == 0, served.stderr[-3000:]
    torch.manual_seed(0)
    images, boxes = torch.randn(1, 3, 8, 8), torch.tensor([[0.0, 0.0, 4.0, 4.0], [2.0, 2.0, 7.0, 7.0]])
    here = flashrt_build.load(roi_align_build.output_dir)(images=images, boxes=boxes).sum().item()
    assert json.loads(served.stdout.strip()) == pytest.approx(here, rel=1e-5)


def test_an_operator_registered_for_inductor_to_decompose_is_decomposed() -> None:
    """torchao keeps its quantization primitives whole through export and
    registers their decomposition with Inductor: a graph quantizing its
    activations (int8 dynamic) runs them as plain aten, not refused."""
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    from flashrt_build.stages.custom_ops import custom_operators, resolve_custom_ops

    layer = torch.nn.Linear(32, 16)
    quantize_(layer, Int8DynamicActivationInt8WeightConfig(set_inductor_config=False))
    x = torch.randn(4, 32)
    program = torch.export.export(layer, (x,))
    assert {op.namespace for op in custom_operators(program)} == {"torchao"}
    program, python, libraries = resolve_custom_ops(program, "layer")
    assert "torchao::choose_qparams_affine" in python and custom_operators(program) == [] and libraries == {}
    torch.testing.assert_close(program.module()(x), layer(x))


def test_a_mixture_of_experts_model_given_as_a_target_runs_its_experts_as_aten(tmp_path: Path) -> None:
    """Mixtral from its config, as a plain `_target_`: its experts' default
    path calls transformers::grouped_mm_fallback (Python-only), which stopped
    the build; the export switches it to batched_mm after the reference ran
    the model as given, and says so (no compile here: the graph is the question)."""
    from flashrt_build.cache.plan import make_plan
    from flashrt_build.stages.custom_ops import custom_operators
    from flashrt_build.stages.export import export_stage
    from flashrt_build.stages.module import instantiate_stage

    conf = module_conf(
        tmp_path,
        "moe",
        "name: moe\nmodel:\n  _target_: transformers.MixtralForCausalLM\n  config:\n"
        "    _target_: transformers.MixtralConfig\n    vocab_size: 256\n    hidden_size: 64\n"
        "    intermediate_size: 128\n    num_hidden_layers: 1\n    num_attention_heads: 4\n"
        "    num_key_value_heads: 2\n    num_local_experts: 4\n    num_experts_per_tok: 2\n"
        "inputs: {input_ids: {shape: [1, 8], dtype: int64, low: 0, high: 256}}\nkwargs: {use_cache: false}\n",
    )
    plan = make_plan(compose(["+module=moe", f"output_root={tmp_path / 'out'}"], config_dir=conf))
    module = instantiate_stage(plan.spec, plan.digests).value
    assert module.config._experts_implementation == "grouped_mm"  # as transformers builds it
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        given = module(input_ids=ids, use_cache=False).logits
    stage = export_stage(module, plan.spec)
    assert stage.sections["experts"] == {"implementation": "batched_mm", "models": 1}
    assert "1 mixture-of-experts model(s) run their experts as batched_mm" in stage.note
    (exported,) = stage.value
    assert not [op for op in custom_operators(exported.program) if op.namespace == "transformers"]
    with torch.no_grad():
        torch.testing.assert_close(exported.program.module()(input_ids=ids).logits, given, rtol=1e-4, atol=1e-4)
