"""Graph passes (`passes=llm`): projections that read one input fused into
one matmul, the module's outputs unchanged, the fused tensors mapped back to
the checkpoint's exactly, and a package built with them verified and
generating transformers' own tokens."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from llm_families import save_family, transformers_tokens
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

import flashrt_build
from flashrt_build.cache.plan import make_plan
from flashrt_build.config.compose import compose
from flashrt_build.errors import WeightsMismatch
from flashrt_build.stages.module import instantiate_stage
from flashrt_build.stages.passes import passes_stage

PROMPT = torch.tensor([[3, 1, 4, 1, 5]])


def llm_overrides(model_dir: Path, root: Path, *more: str) -> list[str]:
    return ["+module=causal_lm", f"module.pretrained={model_dir}", "module.max_cache_len=32",
            "module.max_prompt=16", "weights=external", f"output_root={root / 'out'}", *more]  # fmt: skip


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("passes")
    return save_family("llama", root / "llama"), root


def fused_module(model_dir: Path, root: Path) -> tuple[nn.Module, nn.Module, dict]:
    plan = make_plan(compose(llm_overrides(model_dir, root, "passes=llm")))
    module = instantiate_stage(plan.spec, plan.digests).value
    original = copy.deepcopy(module)
    stage = passes_stage(module, plan.spec)
    return original, module, stage.sections["passes"]


def exported_after_passes(model_dir: Path, root: Path, *more: str) -> tuple[Any, list[Any]]:
    """The plan of these overrides, and its methods exported after its passes ran."""
    from flashrt_build.stages.export import export_stage

    plan = make_plan(compose(llm_overrides(model_dir, root, *more)))
    module = instantiate_stage(plan.spec, plan.digests).value
    passes_stage(module, plan.spec)
    return plan, export_stage(module, plan.spec).value


def test_on_a_cpu_target_the_decode_kernels_of_llm_take_nothing_and_say_why(llama: tuple[Path, Path]) -> None:
    """gemv and decode_attention are CUDA's: `passes=llm` on a CPU fuses and says the rest took nothing
    (pdl too, which llm turns on, and rotary_fusion, which it leaves off)."""
    model_dir, root = llama
    plan = make_plan(compose(llm_overrides(model_dir, root, "passes=llm", "passes.rotary_fusion=true")))
    module = instantiate_stage(plan.spec, plan.digests).value
    stage = passes_stage(module, plan.spec)
    assert stage.sections["passes"]["gemv"] == {"layers": 0, "int8_layers": 0}
    assert stage.sections["passes"]["decode_attention"] == {"models": 0}
    assert stage.sections["passes"]["combo_kernels"] == {"methods": []}
    assert "gemv_fusion" not in stage.sections["passes"]  # the export stage's record: what it rewrote
    assert "no float linear layer on a CUDA device (target.device=cpu)" in stage.note
    assert "no SDPA model on a CUDA device (target.device=cpu)" in stage.note
    assert "combo_kernels: no static-shape method on a CUDA device (target.device=cpu)" in stage.note
    assert "gemv_fusion: no GEMV to fuse into (target.device=cpu)" in stage.note
    assert stage.sections["passes"]["pdl"] == {"launched": False}
    assert "rotary_fusion" not in stage.sections["passes"]
    assert "rotary_fusion: no decode attention to rotate in (target.device=cpu)" in stage.note
    assert "pdl: plain launches (target.device=cpu)" in stage.note
    assert module.model.config._attn_implementation == "sdpa"  # eager and the package keep SDPA
    assert plan.spec.method_inductor_options_of("decode") == {}
    alone = make_plan(compose(llm_overrides(model_dir, root, "passes.gemv_fusion=true")))  # without the gemv pass
    assert "gemv_fusion: no GEMV to fuse into (passes.gemv=false)" in passes_stage(nn.Module(), alone.spec).note
    alone = make_plan(compose(llm_overrides(model_dir, root, "passes.rotary_fusion=true")))
    note = passes_stage(nn.Module(), alone.spec).note
    assert "rotary_fusion: no decode attention to rotate in (passes.decode_attention=false)" in note
    alone = make_plan(compose(llm_overrides(model_dir, root, "target=cuda", "passes.pdl=true")))
    stage = passes_stage(nn.Module(), alone.spec)  # a CUDA target, none of the package's own kernels
    assert "pdl: plain launches (no kernel of its own to launch: passes.gemv=false" in stage.note
    assert stage.sections["passes"]["pdl"] == {"launched": False}


def test_on_a_cuda_target_llm_compiles_the_static_decode_step_with_combo_kernels(llama: tuple[Path, Path]) -> None:
    """Prefill's dynamic prompt keeps Inductor's defaults; a method's own
    `inductor.methods` entry wins over the pass."""
    model_dir, root = llama
    spec = make_plan(compose(llm_overrides(model_dir, root, "target=cuda", "passes=llm"))).spec
    assert spec.combo_methods == ("decode",)
    assert spec.method_inductor_options_of("decode") == {"combo_kernels": True}
    assert spec.method_inductor_options_of("prefill") == {}
    own = [
        "target=cuda",
        "passes=llm",
        "+inductor.methods.decode.combo_kernels=false",
        "+inductor.methods.decode.max_autotune=true",
    ]
    spec = make_plan(compose(llm_overrides(model_dir, root, *own))).spec
    assert spec.method_inductor_options_of("decode") == {"combo_kernels": False, "max_autotune": True}
    spec = make_plan(
        compose(llm_overrides(model_dir, root, "target=cuda", "passes=llm", "passes.combo_kernels=false"))
    ).spec
    assert spec.combo_methods == () and spec.method_inductor_options_of("decode") == {}


def test_fusing_projections_keeps_the_outputs_and_maps_every_row_back(llama: tuple[Path, Path]) -> None:
    model_dir, root = llama
    original, fused, section = fused_module(model_dir, root)
    groups = section["fuse_projections"]["fused"]
    # each of the 2 layers: attention's q/k/v and the MLP's gate/up, nothing else (o_proj, down_proj read other inputs)
    assert (
        sorted(g["weight"].rsplit(".", 2)[-2] for g in groups)
        == ["gate_proj__up_proj"] * 2 + ["q_proj__k_proj__v_proj"] * 2
    )
    assert section["fuse_projections"]["linear_calls_cut"] == 2 * (3 - 1) + 2 * (2 - 1)
    checkpoint = {k: v for f in model_dir.glob("*.safetensors") for k, v in load_file(f).items()}
    params = dict(fused.named_parameters())
    for group in groups:  # the fused tensor is the checkpoint's tensors, row for row
        rebuilt = torch.cat([checkpoint[part["name"]] for part in group["from"]])
        assert torch.equal(params[group["weight"]], rebuilt)
        assert [p["rows"] for p in group["from"]][-1][1] == rebuilt.shape[0]
        assert all(part["name"] not in params for part in group["from"])  # the originals are gone
    with torch.no_grad():
        assert torch.allclose(original.prefill(PROMPT), fused.prefill(PROMPT), atol=1e-5)
        step = (torch.tensor([[7]]), torch.tensor([PROMPT.shape[1]]))
        assert torch.allclose(original.decode(*step), fused.decode(*step), atol=1e-5)


def test_a_fused_layer_fed_different_inputs_gives_each_its_own_output() -> None:
    """The fallback the fused layer keeps: layers of one group called with
    different tensors (or one changed in place) still get their own rows."""
    from flashrt_build.stages.fused import FusedLinear, FusedSlice

    a, b = nn.Linear(4, 3), nn.Linear(4, 2)
    weight, bias = torch.cat([a.weight, b.weight]).detach(), torch.cat([a.bias, b.bias]).detach()
    shared = FusedLinear(weight, bias, [3, 2], ("a", "b"))
    first, second = FusedSlice(shared, 0), FusedSlice(shared, 1)
    x, y = torch.randn(5, 4), torch.randn(5, 4)
    with torch.no_grad():
        assert torch.allclose(first(x), a(x)) and torch.allclose(second(y), b(y))
        first(x)
        x.mul_(2)  # changed in place between the two layers' calls
        assert torch.allclose(second(x), b(x))


@pytest.mark.slow
def test_a_fused_package_verifies_generates_and_cuts_the_matmuls(llama: tuple[Path, Path]) -> None:
    model_dir, root = llama
    # pdl (on in llm) and rotary_fusion (off in llm) on: a CPU build records that they did nothing (the schema
    # checks the record)
    overrides = llm_overrides(model_dir, root, "passes=llm", "passes.rotary_fusion=true")
    result = flashrt_build.build(compose(overrides))
    manifest = result.manifest
    assert manifest["verification"]["passed"] is True
    assert manifest["passes"]["rotary_fusion"] == {"methods": {}} and manifest["passes"]["pdl"] == {"launched": False}
    assert manifest["passes"]["decode_attention"] == {"models": 0, "methods": {}}  # no attention kernel, no mask shared
    assert result.output_dir.name.startswith("cpu-external-default-llm")  # its own folder beside passes=none
    assert "passes" in manifest["timings"] and manifest["config"]["passes"]["fuse_projections"] is True
    fused = {g["weight"] for g in manifest["passes"]["fuse_projections"]["fused"]}
    sidecar = load_file(result.output_dir / manifest["weights"]["file"])
    assert fused <= set(sidecar) and not any(name.endswith("q_proj.weight") for name in sidecar)
    tokens = flashrt_build.generate(flashrt_build.load(result.output_dir), PROMPT, 9).tokens
    assert tokens.tolist() == transformers_tokens(model_dir, PROMPT, 9).tolist()
    # `check` sees the checkpoint's unfused names fit, and a wrong part's shape named
    from flashrt_build.runtime.checkpoint import check_checkpoint

    assert check_checkpoint(result.output_dir, model_dir) == {}
    tensors = {k: v for f in model_dir.glob("*.safetensors") for k, v in load_file(f).items()}
    k_proj = "model.layers.1.self_attn.k_proj.weight"
    whole = tensors[k_proj]
    tensors[k_proj] = whole[:-1].clone()
    save_file(tensors, root / "cut.safetensors")
    problems = check_checkpoint(result.output_dir, root / "cut.safetensors")
    assert list(problems) == ["wrong shape"] and "model.layers.1.self_attn.k_proj.weight" in problems["wrong shape"][0]
    # `load` names a wrong part as `check` does, before fusing it (torch.cat's own error named no tensor)
    tensors[k_proj] = whole[:, :-1].clone()  # a column short: torch.cat refused it
    save_file(tensors, root / "narrow.safetensors")
    for name, shape in (
        ("cut", [whole.shape[0] - 1, whole.shape[1]]),
        ("narrow", [whole.shape[0], whole.shape[1] - 1]),
    ):
        expected = re.escape(str(list(whole.shape)))
        said = rf"wrong shape: {re.escape(k_proj)} {re.escape(str(shape))} \(package expects {expected}"
        with pytest.raises(WeightsMismatch, match=said):
            flashrt_build.load(result.output_dir, weights=root / f"{name}.safetensors")
    # another checkpoint of the architecture, named as transformers names it: fused at load, no recompile
    other = save_family("llama", root / "other", seed=1)
    swapped = flashrt_build.generate(flashrt_build.load(result.output_dir, weights=other), PROMPT, 9).tokens
    assert swapped.tolist() == transformers_tokens(other, PROMPT, 9).tolist() != tokens.tolist()
    # the graph: 2 layers x (qkv, o, gate/up, down) + lm_head matmuls, against 2 x 7 + 1 unfused
    plan, methods = exported_after_passes(model_dir, root, "passes=llm")
    for exported in methods:
        linears = [n for n in exported.program.graph.nodes if n.target is torch.ops.aten.linear.default]
        assert len(linears) == 2 * 4 + 1, exported.method.name
    # turning the pass off is a different build, in the key
    off = make_plan(compose(llm_overrides(model_dir, root, "passes=llm", "passes.fuse_projections=false")))
    assert off.keys["graph_key"] != plan.keys["graph_key"]


def test_a_recipe_quantizes_a_fused_weight_row_for_row_as_it_would_its_layers(llama: tuple[Path, Path]) -> None:
    """Fused before quantized: the fused weight, quantized by its members'
    rule, holds exactly the rows the recipe gives each layer alone, and the
    manifest names the layers it stands for."""
    from flashrt_build.stages.quantize import quantize_stage

    model_dir, root = llama
    plan = make_plan(compose(llm_overrides(model_dir, root, "passes=llm", "quant=int8_wo")))
    fused = instantiate_stage(plan.spec, plan.digests).value
    alone = copy.deepcopy(fused)
    section = passes_stage(fused, plan.spec).sections["passes"]["fuse_projections"]
    modules = quantize_stage(fused, plan.spec).sections["quant"]["modules"]
    quantize_stage(alone, plan.spec)
    assert len(section["fused"]) == 4 and section["left"] == []
    for group in section["fused"]:
        layer = group["weight"].removesuffix(".weight")
        names = [part["name"].removesuffix(".weight") for part in group["from"]]
        assert is_traceable_wrapper_subclass(fused.get_submodule(layer).weight)  # quantized, as torchao makes it
        rows = torch.cat([alone.get_submodule(name).weight.dequantize() for name in names])
        assert torch.equal(fused.get_submodule(layer).weight.dequantize(), rows)
        assert modules[layer]["fused_from"] == names and modules[layer]["shape"] == [rows.shape[0], rows.shape[1]]
        assert not set(names) & set(modules)  # recorded once, as the layer the package binds
    with torch.no_grad():
        assert torch.allclose(fused.prefill(PROMPT), alone.prefill(PROMPT), atol=1e-5)


def test_layers_rules_decide_apart_or_would_quantize_as_one_stay_unfused(llama: tuple[Path, Path]) -> None:
    model_dir, root = llama

    def passes(rules: str) -> dict[str, Any]:
        plan = make_plan(compose(llm_overrides(model_dir, root, "passes=llm", "quant=int8_wo", f"quant.rules={rules}")))
        module = instantiate_stage(plan.spec, plan.digests).value
        return passes_stage(module, plan.spec).sections["passes"]["fuse_projections"]

    # q_proj kept float by its own rule: k and v still fuse, q stays a layer of its own
    split = passes('[{pattern: "*q_proj", config: skip}, {pattern: "*", config: Int8WeightOnlyConfig}]')
    fused = sorted(g["weight"].rsplit(".", 2)[-2] for g in split["fused"])
    assert fused == ["gate_proj__up_proj"] * 2 + ["k_proj__v_proj"] * 2
    # one scale per tensor: quantized as one, the rows would change, so nothing fuses, each group saying why
    shared = passes("[{pattern: '*', config: Int8WeightOnlyConfig, args: {granularity: per_tensor}}]")
    assert shared["fused"] == [] and len(shared["left"]) == 4
    assert all(g["rule"] == "quant.rules[0]" and "share scales" in g["why"] for g in shared["left"])


def test_grouped_attention_gives_transformers_sdpa_outputs_without_its_copies() -> None:
    """The folded attention against transformers' own SDPA (which copies each
    KV head per query head under a mask): a decode row, a prefill block under
    a causal mask with padding, and the cases it hands back to SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from flashrt_build.stages.attention import grouped_sdpa

    torch.manual_seed(0)
    layer = nn.Module()
    layer.num_key_value_groups, layer.is_causal = 4, True
    key, value = torch.randn(2, 2, 12, 16), torch.randn(2, 2, 12, 16)
    for length in (1, 5):
        query = torch.randn(2, 8, length, 16)
        mask = torch.ones(2, 1, length, 12, dtype=torch.bool).tril(12 - length)
        mask[1, :, :, :3] = False  # the second sequence padded on the left
        for given in (mask, None):
            expected, _ = sdpa_attention_forward(layer, query, key, value, given, scaling=0.25)
            got, _ = grouped_sdpa(layer, query, key, value, given, scaling=0.25)
            assert got.shape == (2, length, 8, 16) and torch.allclose(got, expected, atol=1e-5), (length, given)


@pytest.mark.slow
def test_a_grouped_attention_package_verifies_generates_and_copies_no_cache(llama: tuple[Path, Path]) -> None:
    """`passes.grouped_attention=true`: the package verified and giving
    transformers' tokens, its graphs without the per-head copies of the cache."""
    model_dir, root = llama
    overrides = llm_overrides(model_dir, root, "passes.grouped_attention=true")
    result = flashrt_build.build(compose(overrides))
    assert result.manifest["verification"]["passed"] is True
    assert result.manifest["passes"] == {"name": "none", "grouped_attention": {"models": 1}}
    tokens = flashrt_build.generate(flashrt_build.load(result.output_dir), PROMPT, 9).tokens
    assert tokens.tolist() == transformers_tokens(model_dir, PROMPT, 9).tolist()

    def cache_copies(*more: str) -> dict[str, int]:
        """Per method, the tensors of (batch, query heads, cache length, head dim): the cache copied per head."""
        return {
            e.method.name: sum(
                1
                for n in e.program.graph.nodes
                if n.op == "call_function" and tuple(getattr(n.meta.get("val"), "shape", ())) == (1, 4, 32, 16)
            )
            for e in exported_after_passes(model_dir, root, *more)[1]
        }

    assert cache_copies() == {"prefill": 4, "decode": 4}  # k and v of 2 layers, for 4 query heads over 2 KV heads
    assert cache_copies("passes.grouped_attention=true") == {"prefill": 0, "decode": 0}
