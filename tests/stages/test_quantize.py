"""Quantized packages (`quant=RECIPE`, torchao): the recipe's rules and
errors without a compile; int8 weight-only builds, baked (the mlp) and
external (tiny_lm trained here, so its tokens are decided), on the CPU.
GPU-only recipes (int4, float8) are refused here as config errors."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from clitools import cli
from greedy import eager_greedy, train_on_a_cycle
from safetensors.torch import save_file

import flashrt_build
from flashrt_build.config.compose import compose
from flashrt_build.config.spec import resolve_spec
from flashrt_build.errors import ConfigError, VerifyError, WeightsMismatch
from flashrt_build.examples import MLP
from flashrt_build.runtime.checkpoint import check_checkpoint
from flashrt_build.stages import compile as compiled
from flashrt_build.stages.compare import quantization_error
from flashrt_build.stages.module import instantiate_module
from flashrt_build.stages.quantize import rules_for, torchao_configs, torchao_version
from flashrt_build.stages.weights import program_tensors

RULES = "quant.rules=[{pattern: fc1, config: skip}, {pattern: 'fc*', config: Int8WeightOnlyConfig}]"


def spec_of(*overrides: str):
    return resolve_spec(compose(["+module=mlp", "quant=int8_wo", *overrides]))


# the recipe, without a compile ------------------------------------------------


def test_no_recipe_is_the_default_and_quantizes_nothing() -> None:
    assert resolve_spec(compose(["+module=mlp"])).quant is None


def test_the_first_matching_rule_decides_each_linear() -> None:
    spec = spec_of(RULES)
    decided = rules_for(MLP(), spec.quant, spec.target)
    assert {name: rule.config for name, rule in decided.items()} == {"fc1": "skip", "fc2": "Int8WeightOnlyConfig"}


def test_a_rule_that_decides_nothing_is_an_error_unless_optional() -> None:
    """A mistyped skip pattern would quietly quantize the module it meant to keep."""
    spec = spec_of("quant.rules=[{pattern: lm_head, config: skip}, {pattern: '*', config: Int8WeightOnlyConfig}]")
    with pytest.raises(
        ConfigError, match=r"'quant.rules\[0\].pattern' = 'lm_head': decides no Linear module .*fc1, fc2"
    ):
        rules_for(MLP(), spec.quant, spec.target)
    shadowed = spec_of("quant.rules=[{pattern: '*', config: Int8WeightOnlyConfig}, {pattern: fc2, config: skip}]")
    with pytest.raises(ConfigError, match=r"quant.rules\[1\].pattern' = 'fc2'.*each by an earlier rule"):
        rules_for(MLP(), shadowed.quant, shadowed.target)
    shipped = spec_of()  # int8_wo's `*lm_head` skip is optional: the mlp has none
    assert {r.config for r in rules_for(MLP(), shipped.quant, shipped.target).values()} == {"Int8WeightOnlyConfig"}


def test_a_recipe_the_target_cannot_run_is_refused_before_any_work(tmp_path: Path) -> None:
    done = cli("+module=mlp", "quant=fp8", f"output_root={tmp_path}")
    assert done.returncode == 2
    assert "config key 'quant' = 'fp8': the recipe runs on cuda only (quant.devices); the target is cpu" in done.stderr
    assert {p.name for p in tmp_path.iterdir()} <= {".runs"}  # Hydra's log, no build
    with pytest.raises(ConfigError, match=r"'quant' = 'int4_wo': the recipe runs on cuda only"):
        resolve_spec(compose(["+module=mlp", "quant=int4_wo"]))


def test_unknown_torchao_configs_and_wrong_arguments_name_their_rule() -> None:
    spec = spec_of("quant.rules=[{pattern: '*', config: Int8WeightOnly}]")
    with pytest.raises(ConfigError, match=r"quant.rules\[0\].config' = 'Int8WeightOnly': not a config of torchao"):
        torchao_configs(spec.quant, spec.device)
    spec = spec_of("quant.rules=[{pattern: '*', config: Int8WeightOnlyConfig, args: {group_sizes: 4}}]")
    with pytest.raises(ConfigError, match=r"quant.rules\[0\].args' = \{'group_sizes': 4\}: Int8WeightOnlyConfig: "):
        torchao_configs(spec.quant, spec.device)
    spec = spec_of("quant.rules=[{pattern: '*', config: Int8WeightOnlyConfig, args: {set_inductor_config: true}}]")
    with pytest.raises(ConfigError, match=r"set_inductor_config' = True: torchao would set Inductor options for the"):
        torchao_configs(spec.quant, spec.device)
    with pytest.raises(ConfigError, match=r"quant.rules\[0\].args.*a 'skip' rule takes no args"):
        spec_of("quant.rules=[{pattern: '*', config: skip, args: {x: 1}}]")


def test_a_recipes_inductor_options_are_explicit_and_the_groups_own_win() -> None:
    assert spec_of().inductor_options["force_fuse_int_mm_with_mul"] is True
    assert (
        spec_of("+inductor.options.force_fuse_int_mm_with_mul=false").inductor_options["force_fuse_int_mm_with_mul"]
        is False
    )
    (config,) = [c for c in torchao_configs(spec_of().quant, "cpu").values() if c is not None]
    assert config.set_inductor_config is False  # torchao would set them for the process, unrecorded


def test_a_quantized_weight_is_listed_as_the_parts_the_package_binds() -> None:
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    module = MLP().eval()
    quantize_(module, Int8WeightOnlyConfig(set_inductor_config=False))
    program = torch.export.export(module, (torch.randn(2, 16),))
    parts = {t.name: (t.owner, t.part, t.tensor.dtype) for t in program_tensors(program) if t.part}
    assert parts["fc1.parametrizations.weight.original0"] == ("fc1.weight", "qdata", torch.int8)
    assert parts["fc1.parametrizations.weight.original1"] == ("fc1.weight", "scale", torch.float32)
    assert parts["fc1.parametrizations.weight.original2"][1] == "zero_point"


def test_the_quantization_error_past_its_bound_fails_naming_where() -> None:
    reference = [{"logits": torch.tensor([[1.0, 2.0, 3.0], [3.0, 1.0, 0.0]])}]
    close = [[torch.tensor([[1.0, 2.0, 3.1], [3.0, 1.0, 0.0]])]]
    record = quantization_error(["example"], close, reference, bound=0.05)
    assert record["passed"] and record["top1_agreement"] == 1.0 and 0 < record["max_rel_err"] < 0.05
    flipped = [[torch.tensor([[1.0, 3.5, 3.0], [3.0, 1.0, 0.0]])]]
    assert quantization_error(["example"], flipped, reference, bound=None)["top1_agreement"] == 0.5
    with pytest.raises(VerifyError, match=r"= 0\.3.* at \['logits'\] at example, past quant.max_rel_error=0.05"):
        quantization_error(["example"], flipped, reference, bound=0.05)


# a method's own config over the same weights (int8_dq_prefill) ----------------

LM_DQ = ["+module=tiny_lm", "quant=int8_dq_prefill", "quant.rules.0.pattern=head"]


def dq_rules(config: str, args: str) -> str:
    """int8_dq_prefill's rules for tiny_lm, prefill's own config and arguments these."""
    prefill = f"{{prefill: {{config: {config}, args: {args}}}}}"
    quantized = f"{{pattern: '*', config: Int8WeightOnlyConfig, methods: {prefill}}}"
    return f"quant.rules=[{{pattern: head, config: skip}}, {quantized}]"


def test_a_methods_own_config_must_name_a_method_and_quantize_weights_as_its_rule_does() -> None:
    with pytest.raises(
        ConfigError, match=r"'quant.rules\[1\].methods.prefill' = .*not a method of this module; its methods: forward"
    ):
        spec_of("quant=int8_dq_prefill")
    with pytest.raises(
        ConfigError, match=r"'quant.rules\[0\].methods.prefill.config' = 'Int8WeightOnlyConfig': .*'skip'"
    ):
        resolve_spec(
            compose(
                [
                    *LM_DQ,
                    "quant.rules=[{pattern: '*', config: skip, methods: {prefill: {config: Int8WeightOnlyConfig}}}]",
                ]
            )
        )
    spec = resolve_spec(compose([*LM_DQ, dq_rules("Int8DynamicActivationInt8WeightConfig", "{granularity: per_row}")]))
    assert spec.quant is not None and spec.quant.rules[1].methods["prefill"].key == "quant.rules[1].methods.prefill"
    assert {key: type(c).__name__ for key, c in torchao_configs(spec.quant, spec.device).items()} == {
        "quant.rules[0]": "NoneType",
        "quant.rules[1]": "Int8WeightOnlyConfig",
        "quant.rules[1].methods.prefill": "Int8DynamicActivationInt8WeightConfig",
    }


def test_a_recipe_quantizing_activations_brings_the_least_rtol_and_verify_rtol_wins() -> None:
    assert spec_of().rtol is None  # weight-only: float32's own tolerance
    assert resolve_spec(compose(LM_DQ)).rtol == 0.03
    assert resolve_spec(compose([*LM_DQ, "verify.rtol=0.001"])).rtol == 0.001
    assert spec_of("quant.rtol=0.01", "target.dtype=bfloat16").rtol == 0.05  # bf16's own is looser already
    with pytest.raises(ConfigError, match=r"'quant.rtol' = -1.0: expected a relative error >= 0"):
        spec_of("quant.rtol=-1")


def test_a_methods_own_weights_are_the_rules_tensors_and_only_that_method_quantizes_activations() -> None:
    from flashrt_build.cache.plan import make_plan
    from flashrt_build.stages.export import export_stage
    from flashrt_build.stages.module import instantiate_stage
    from flashrt_build.stages.quantize import quantize_stage

    plan = make_plan(compose(LM_DQ))
    module = instantiate_stage(plan.spec, plan.digests).value
    stage = quantize_stage(module, plan.spec)
    own = stage.value.methods
    assert set(own) == {"prefill"} and len(own["prefill"]) == 8 and "prefill: 8 called by its own config" in stage.note
    for name, weight in own["prefill"].items():
        bound = module.get_submodule(name).weight
        assert weight.qdata.data_ptr() == bound.qdata.data_ptr() and weight.scale.data_ptr() == bound.scale.data_ptr()
        assert weight.act_quant_kwargs is not None and bound.act_quant_kwargs is None
    assert stage.sections["quant"]["rules"][1]["methods"] == {
        "prefill": {"config": "Int8DynamicActivationInt8WeightConfig", "args": {}}
    }
    programs = {e.method.name: e.program for e in export_stage(module, plan.spec, own).value}
    int8_matmuls = {
        name: sum(n.target is torch.ops.aten._int_mm.default for n in program.graph.nodes)
        for name, program in programs.items()
    }
    assert int8_matmuls == {"prefill": 8, "decode": 0}
    # a method's config that would quantize the weights otherwise (one scale a tensor) is refused, naming it
    plan = make_plan(compose([*LM_DQ, dq_rules("Int8DynamicActivationInt8WeightConfig", "{granularity: per_tensor}")]))
    module = instantiate_stage(plan.spec, plan.digests).value
    match = (
        r"'quant.rules\[1\].methods.prefill.config' = 'Int8DynamicActivationInt8WeightConfig': quantizes the weights"
    )
    with pytest.raises(ConfigError, match=match + r" otherwise .*qdata, scale.* differ"):
        quantize_stage(module, plan.spec)


def test_a_cuda_graphs_int8_matmuls_take_any_row_count() -> None:
    """cuBLAS's int8 matmul refuses 16 rows or fewer: on a CUDA target each
    call gets 16 zero rows more, cut off after; the product is unchanged."""
    from flashrt_build.stages.int8_matmul import pad_int8_matmuls

    class Matmul(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randint(-127, 128, (32, 64), dtype=torch.int8), requires_grad=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch._int_mm(x, self.weight.t())

    rows = torch.export.Dim("rows", min=2, max=512)
    program = torch.export.export(Matmul(), (torch.zeros(20, 64, dtype=torch.int8),), dynamic_shapes=({0: rows},))
    assert pad_int8_matmuls(program, "cpu") == (program, 0)  # the CPU's takes any count
    padded, count = pad_int8_matmuls(program, "cuda")
    (matmul,) = [n for n in padded.graph.nodes if n.target is torch.ops.aten._int_mm.default]
    assert (
        count == 1 and matmul.args[0].target is torch.ops.aten.pad.default and matmul.args[0].args[1] == [0, 0, 0, 16]
    )
    for count in (2, 16, 17, 300):
        x = torch.randint(-127, 128, (count, 64), dtype=torch.int8)
        assert torch.equal(padded.module()(x), program.module()(x))


def test_a_cuda_graphs_int8_matmuls_traced_as_out_dtype_are_padded_too() -> None:
    """Exported on a CUDA device, torchao's int8 matmul is `out_dtype(mm,
    int32, ...)`, which Inductor lowers to cuBLAS's after the export: a
    prompt of 8 failed on an H100 ("self.size(0) needs to be greater than 16")."""
    from torch._higher_order_ops.out_dtype import out_dtype

    from flashrt_build.stages.int8_matmul import pad_int8_matmuls

    class Matmul(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randint(-127, 128, (32, 64), dtype=torch.int8), requires_grad=False)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            float_mm = out_dtype(torch.ops.aten.mm.default, torch.float32, y, y.t())  # not int8: left alone
            return out_dtype(torch.ops.aten.mm.default, torch.int32, x, self.weight.t()), float_mm

    rows = torch.export.Dim("rows", min=2, max=512)
    example = (torch.zeros(20, 64, dtype=torch.int8), torch.ones(3, 4, dtype=torch.bfloat16))
    program = torch.export.export(Matmul(), example, dynamic_shapes=({0: rows}, None))
    padded, count = pad_int8_matmuls(program, "cuda")
    (matmul,) = [n for n in padded.graph.nodes if n.target is torch.ops.aten._int_mm.default]
    assert count == 1 and matmul.args[0].target is torch.ops.aten.pad.default
    assert sum(n.target is out_dtype for n in padded.graph.nodes) == 1  # the float one
    y = torch.randn(3, 4, dtype=torch.bfloat16)
    for count in (2, 8, 300):
        x = torch.randint(-127, 128, (count, 64), dtype=torch.int8)
        ours, theirs = padded.module()(x, y), program.module()(x, y)
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


# int8 weight-only builds on the CPU -------------------------------------------


@pytest.fixture(scope="module")
def mlp_int8(tmp_path_factory: pytest.TempPathFactory) -> flashrt_build.BuildResult:
    out = tmp_path_factory.mktemp("mlp_int8") / "out"
    return flashrt_build.build(
        compose(["+module=mlp", "quant=int8_wo", f"output_dir={out}", f"output_root={out.parent}"])
    )


@pytest.mark.slow
def test_an_int8_package_verifies_and_its_manifest_says_what_was_quantized(mlp_int8: flashrt_build.BuildResult) -> None:
    manifest = mlp_int8.manifest
    assert manifest["inductor"]["options"]["coordinate_descent_tuning"] is True  # the recipe's, recorded
    assert torch._inductor.config.coordinate_descent_tuning is False  # and never set for the whole process
    quant = manifest["quant"]
    assert quant["name"] == "int8_wo" and quant["torchao"] == torchao_version() == manifest["toolchain"]["torchao"]
    assert quant["modules"]["fc1"] == {
        "rule": 1,
        "config": "Int8WeightOnlyConfig",
        "shape": [64, 16],
        "dtype": "float32",
    }
    assert manifest["key_ingredients"]["toolchain"]["torchao"] == torchao_version()  # part of the build key
    tensors = {t["fqn"]: t for t in manifest["weights"]["tensors"]}
    data = tensors["fc1.parametrizations.weight.original0"]
    assert data["dtype"] == "int8" and data["shape"] == [64, 16]
    assert data["quantized"] == {"from": "fc1.weight", "part": "qdata"} and "fc1.weight" not in tensors
    assert "fc1.parametrizations.weight.original2" in manifest["weights"]["unused"]  # the zero point, never read
    verification = manifest["verification"]
    assert verification["passed"] and verification["quantization"]["bound"] == 0.05
    assert 0 < verification["quantization"]["max_rel_err"] < 0.05
    assert verification["quantization"]["top1_agreement"] > 0.9


@pytest.fixture(scope="module")
def trained_lm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    """tiny_lm trained on a one-rule language (its tokens decided, not near-ties): a float checkpoint."""
    module = instantiate_module(resolve_spec(compose(["+module=tiny_lm"])))
    cycle = train_on_a_cycle(module)
    path = tmp_path_factory.mktemp("trained_lm") / "model.safetensors"
    save_file({name: t.detach().contiguous() for name, t in module.state_dict().items()}, path)
    return path, cycle


def nbytes(shape: list[int], dtype: str) -> int:
    return math.prod(shape) * torch.empty(0, dtype=getattr(torch, dtype)).element_size()


def build_lm(out: Path, checkpoint: Path, *overrides: str, recipe: str = "int8_wo") -> flashrt_build.BuildResult:
    overrides = (
        "+module=tiny_lm",
        f"quant={recipe}",
        "weights=external",
        f"module.checkpoint={checkpoint}",
        *overrides,
    )
    return flashrt_build.build(compose([*overrides, f"output_dir={out}", f"output_root={out.parent}"]))


@pytest.fixture(scope="module")
def lm_int8(
    tmp_path_factory: pytest.TempPathFactory, trained_lm: tuple[Path, torch.Tensor]
) -> flashrt_build.BuildResult:
    return build_lm(tmp_path_factory.mktemp("lm_int8") / "out", trained_lm[0])


@pytest.mark.slow
def test_a_trained_lm_quantized_to_int8_generates_the_float_models_tokens(
    lm_int8: flashrt_build.BuildResult, trained_lm: tuple[Path, torch.Tensor]
) -> None:
    quantization = lm_int8.manifest["verification"]["quantization"]
    assert quantization["top1_agreement"] == 1.0 and quantization["max_rel_err"] < 0.05
    tensors = lm_int8.manifest["weights"]["tensors"]
    assert {t["fqn"]: t for t in tensors}["head.parametrizations.weight.original0"]["dtype"] == "int8"
    # bytes bound, against the float weights they replaced (the embeddings and norms stay float32)
    quantized_bytes = sum(nbytes(t["shape"], t["dtype"]) for t in tensors)
    modules = lm_int8.manifest["quant"]["modules"].values()
    float_bytes = sum(nbytes(t["shape"], t["dtype"]) for t in tensors if not t.get("quantized")) + sum(
        nbytes(m["shape"], m["dtype"]) for m in modules if m["config"] != "skip"
    )
    assert quantized_bytes < 0.45 * float_bytes
    float_lm = instantiate_module(resolve_spec(compose(["+module=tiny_lm", f"module.checkpoint={trained_lm[0]}"])))
    prompt = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(3))
    expected = eager_greedy(float_lm, prompt, 40)
    assert torch.equal(flashrt_build.generate(flashrt_build.load(lm_int8.output_dir), prompt, 40).tokens, expected)
    assert torch.equal(expected[0, 1:], trained_lm[1][expected[0, :-1]])  # the rule it learned


@pytest.mark.slow
def test_the_runtime_serves_a_quantized_package_without_torchao(lm_int8: flashrt_build.BuildResult) -> None:
    script = (
        "import sys, torch; sys.modules['torchao'] = None\n"  # any import of torchao fails
        "import flashrt_build\n"
        f"lm = flashrt_build.load({str(lm_int8.output_dir)!r})\n"
        "print(flashrt_build.generate(lm, torch.tensor([[1, 2, 3]]), 8).tokens.tolist())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    lm = flashrt_build.load(lm_int8.output_dir)
    assert json.loads(done.stdout) == flashrt_build.generate(lm, torch.tensor([[1, 2, 3]]), 8).tokens.tolist()


@pytest.mark.slow
def test_a_new_float_checkpoint_is_quantized_and_bound_without_recompiling(
    lm_int8: flashrt_build.BuildResult, tmp_path: Path
) -> None:
    torch.manual_seed(7)
    other = tmp_path / "other.safetensors"
    module = instantiate_module(resolve_spec(compose(["+module=tiny_lm", "seed=7"])))
    save_file({name: t.detach().contiguous() for name, t in module.state_dict().items()}, other)
    # `check` compares a float checkpoint with the weights as they were before quantization
    done = subprocess.run(
        [sys.executable, "-m", "flashrt_build.check", lm_int8.output_dir, other], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    with pytest.raises(WeightsMismatch, match=r"quantized \(quant=int8_wo\).*Build with module.checkpoint=THAT_FILE"):
        flashrt_build.load(lm_int8.output_dir, weights=other)  # parts, not float weights, bind
    swapped = build_lm(lm_int8.output_dir.parent / "swapped", other)  # the same store: its compiled models
    assert {m["compiled"] for m in swapped.manifest["methods"].values()} == {"reused"}
    assert swapped.manifest["package"]["sha256"] == lm_int8.manifest["package"]["sha256"]
    before = {t["fqn"]: t["sha256"] for t in lm_int8.manifest["weights"]["tensors"]}
    after = {t["fqn"]: t["sha256"] for t in swapped.manifest["weights"]["tensors"]}
    assert (
        after.keys() == before.keys()
        and after["head.parametrizations.weight.original0"] != (before["head.parametrizations.weight.original0"])
    )
    assert swapped.manifest["verification"]["passed"] is True


@pytest.mark.slow
def test_prefill_quantizing_its_activations_binds_the_very_weights_of_int8_wo(
    lm_int8: flashrt_build.BuildResult, trained_lm: tuple[Path, torch.Tensor]
) -> None:
    """int8_dq_prefill: the same int8 weights as int8_wo, bound once for both
    methods; prefill's matmuls int8 x int8, verified within the recipe's
    rtol, and greedy tokens still the float model's."""
    out = lm_int8.output_dir.parent / "dq_prefill"
    result = build_lm(out, trained_lm[0], recipe="int8_dq_prefill")
    manifest = result.manifest
    assert manifest["verification"]["passed"] is True and manifest["verification"]["quantization"]["max_rel_err"] < 0.05
    assert manifest["quant"]["rules"][1]["methods"]["prefill"]["config"] == "Int8DynamicActivationInt8WeightConfig"
    # the very tensors int8_wo binds, each a part of the weight it was (`check` maps a float checkpoint back)
    tensors = {t["fqn"]: (t["sha256"], t.get("quantized")) for t in manifest["weights"]["tensors"]}
    assert tensors == {t["fqn"]: (t["sha256"], t.get("quantized")) for t in lm_int8.manifest["weights"]["tensors"]}
    quantized = [t for t in manifest["weights"]["tensors"] if t.get("quantized")]
    assert quantized and all(set(t["methods"]) == {"prefill", "decode"} for t in quantized)  # one copy, both
    assert check_checkpoint(result.output_dir, trained_lm[0]) == {}
    prompt = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(3))
    float_lm = instantiate_module(resolve_spec(compose(["+module=tiny_lm", f"module.checkpoint={trained_lm[0]}"])))
    expected = eager_greedy(float_lm, prompt, 40)
    assert torch.equal(flashrt_build.generate(flashrt_build.load(result.output_dir), prompt, 40).tokens, expected)


@pytest.mark.slow
def test_a_package_past_the_recipes_error_bound_is_not_published(
    lm_int8: flashrt_build.BuildResult, trained_lm: tuple[Path, torch.Tensor]
) -> None:
    out = lm_int8.output_dir.parent / "strict"
    match = r"quantization error against the float module.*past quant.max_rel_error=1e-06"
    with mock.patch.object(compiled, "compile_package") as compiler, pytest.raises(VerifyError, match=match):
        build_lm(out, trained_lm[0], "quant.max_rel_error=1e-6")
    assert compiler.call_count == 0  # the bound judges the package, it is no part of its key
    assert not out.exists() and not list(out.parent.glob(".staging-*"))


def test_a_quantized_build_lands_beside_the_float_one() -> None:
    assert resolve_spec(compose(["+module=mlp"])).output_dir.name == "cpu-baked-default"
    assert spec_of().output_dir.name == "cpu-baked-default-int8_wo"
