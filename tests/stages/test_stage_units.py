"""Pure logic of the stages: inputs, options, checkpoints, comparison. No compiles."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from transformers.modeling_outputs import BaseModelOutput

from flashrt_build.config.compose import CONF_DIR, compose
from flashrt_build.config.inputs import MethodSpec
from flashrt_build.config.spec import resolve_spec
from flashrt_build.errors import ConfigError, VerifyError
from flashrt_build.runtime.formats import resolve_checkpoint
from flashrt_build.runtime.reader import read_checkpoint
from flashrt_build.stages.checkpoint import load_checkpoint
from flashrt_build.stages.compare import compare_outputs, raise_on_mismatch, tolerances
from flashrt_build.stages.compile import FORCED_OPTIONS
from flashrt_build.stages.domain import _eager_failure, every_block
from flashrt_build.stages.export import export_module
from flashrt_build.stages.inputs import ExampleInputs, dynamic_shapes, make_inputs
from flashrt_build.stages.module import instantiate_module
from flashrt_build.stages.preflight import validate_inductor_options
from flashrt_build.stages.reference import plan_calls, run_eager
from flashrt_build.stages.verify_process import _package_said, _what, _where
from flashrt_build.stages.weights import tensor_sha256


def spec_of(*overrides: str):
    return resolve_spec(compose(list(overrides)))


# inputs -----------------------------------------------------------------------


def test_example_inputs_are_seeded() -> None:
    spec = spec_of("+module=mlp")
    a, b = make_inputs(spec), make_inputs(spec)
    assert torch.equal(a.kwargs["x"], b.kwargs["x"])
    assert not torch.equal(a.kwargs["x"], make_inputs(spec, seed=spec.seed + 1).kwargs["x"])
    assert a.kwargs["x"].shape == (4, 16) and a.kwargs["x"].dtype == torch.float32


def test_integer_inputs_respect_low_high_and_hold_tensors_only() -> None:
    example = make_inputs(spec_of("+module=gpt2_tiny"))
    ids = example.kwargs["input_ids"]
    assert ids.dtype == torch.int64 and ids.shape == (2, 32)
    assert int(ids.min()) >= 0 and int(ids.max()) < 1000 and int(ids.max()) > 100
    assert list(example.kwargs) == ["input_ids"]  # use_cache=False is bound into the exported method instead
    mask = make_inputs(spec_of("+module=bert_tiny")).kwargs["attention_mask"]
    assert set(mask.unique().tolist()) == {0, 1}  # a mask may hold padding
    edges = make_inputs(spec_of("+module=gpt2_tiny"), edges={"input_ids": "both"}).kwargs["input_ids"]
    assert edges.view(-1)[0] == 0 and torch.all(edges.view(-1)[1:] == 999)


def test_float_inputs_follow_the_target_dtype() -> None:
    assert make_inputs(spec_of("+module=mlp", "target.dtype=bfloat16")).kwargs["x"].dtype == torch.bfloat16


def test_positional_inputs_go_in_args_in_order() -> None:
    spec = spec_of("+module=mlp", "module.inputs.x.positional=true")
    example = make_inputs(spec)
    assert len(example.args) == 1 and "x" not in example.kwargs


def test_sizes_override_shared_dims_everywhere() -> None:
    example = make_inputs(spec_of("+module=bert_tiny"), sizes={"seq": 7})
    assert example.kwargs["input_ids"].shape == (2, 7) and example.kwargs["attention_mask"].shape == (2, 7)


def test_a_failing_layers_skip_pattern_covers_it_in_every_block() -> None:
    assert every_block("blocks.0.mlp.2") == "blocks.*.mlp.2"
    assert every_block("model.layers.13.self_attn.o_proj") == "model.layers.*.self_attn.o_proj"
    assert every_block("head") == "head"
    assert every_block("2") == "2"


class NoFastPath(torch.nn.Module):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("no fast path for these ids")


class FallsBack(torch.nn.Module):
    """Catches its first layer's error, then fails in `then`'s way."""

    def __init__(self, then: str) -> None:
        super().__init__()
        self.fast, self.slow, self.then = NoFastPath(), torch.nn.Embedding(4, 2), then

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        try:
            return self.fast(ids)
        except RuntimeError as caught:
            if self.then == "own code":
                return ids[:, 9]  # IndexError here, not in a submodule
            if self.then == "slow":
                return self.slow(ids + 10)  # IndexError in the embedding
            raise ValueError("the fast path failed") from caught


@pytest.mark.parametrize(
    ("then", "error", "where"),
    [("own code", IndexError, ""), ("slow", IndexError, "slow"), ("wrapped", ValueError, "fast")],
)
def test_an_eager_failure_names_the_submodule_it_began_in_past_errors_the_model_caught(
    then: str, error: type[Exception], where: str
) -> None:
    method = MethodSpec("forward", "forward", (), {}, "model", "module")
    found = _eager_failure(FallsBack(then), method, ExampleInputs((torch.zeros(1, 3, dtype=torch.long),), {}))
    assert found is not None and (found.error, found.where) == (error, where)
    assert (
        _eager_failure(torch.nn.Embedding(4, 2), method, ExampleInputs((torch.ones(1, 3, dtype=torch.long),), {}))
        is None
    )


def test_dynamic_shapes_share_one_dim_object_per_name() -> None:
    spec = spec_of("+module=bert_tiny")
    example = make_inputs(spec)
    shapes = dynamic_shapes(spec, example)
    ids, mask = shapes[example.kwargs["input_ids"]], shapes[example.kwargs["attention_mask"]]
    assert ids[1] is mask[1]
    assert (ids[1].min, ids[1].max) == (2, 128)


def test_verification_calls_cover_example_min_odd_mid_max_and_a_repeat_chain() -> None:
    calls = plan_calls(spec_of("+module=mlp"), repeat=3)
    assert [c.sizes for c in calls] == [{}, {"batch": 1}, {"batch": 33}, {"batch": 64}, {}, {}, {}]
    assert [c.label for c in calls][-3:] == ["repeat 1", "repeat 2", "repeat 3"]
    assert [c.inputs["x"].shape[0] for c in calls] == [4, 1, 33, 64, 4, 4, 4]
    assert not torch.equal(calls[4].inputs["x"], calls[5].inputs["x"])  # fresh inputs at every step
    bert = plan_calls(spec_of("+module=bert_tiny"), repeat=0)
    assert [c.sizes for c in bert] == [{}, {"seq": 2}, {"seq": 65}, {"seq": 128}]
    assert bert[2].inputs["attention_mask"].shape == (2, 65)


def test_the_reference_runs_the_max_at_the_ranges_ends_so_the_inputs_stage_does_not_again() -> None:
    from flashrt_build.stages.domain import inputs_stage
    from flashrt_build.stages.reference import Reference

    spec = spec_of("+module=bert_tiny")
    calls = plan_calls(spec, repeat=0)
    at_max = calls[-1]
    assert at_max.sizes == {"seq": 128} and at_max.edges == {"input_ids": "both", "attention_mask": "both"}
    ids = at_max.inputs["input_ids"]
    assert (int(ids.min()), int(ids.max())) == (0, 999) and not any(c.edges for c in calls[:-1])
    module = instantiate_module(spec)
    lengths: list[int] = []
    forward = module.forward

    @functools.wraps(forward)
    def counted(*args: Any, **kwargs: Any) -> Any:
        lengths.append(kwargs["input_ids"].shape[1])
        return forward(*args, **kwargs)

    module.forward = counted  # the stage calls the method itself, as the package's callers do
    inputs_stage(module, spec)
    assert 128 in lengths  # alone, the stage runs the max
    lengths.clear()
    note = inputs_stage(module, spec, Reference(calls).ran_at_edges()).note
    assert 128 not in lengths and "at the max: the reference's call" in note
    failed = Reference(calls, failure=VerifyError("raised"))
    assert failed.ran_at_edges() == set()  # a reference that raised proves nothing
    assert Reference(plan_calls(spec_of("+module=mlp"), repeat=0)).ran_at_edges() == {("forward", (("batch", 64),))}


# inductor options -------------------------------------------------------------


def test_known_options_pass_and_forced_ones_are_added() -> None:
    options = validate_inductor_options({"max_autotune": True, "cpp.threads": 2})
    assert options["max_autotune"] is True and options["cpp.threads"] == 2
    assert all(options[k] == v for k, v in FORCED_OPTIONS.items())


def test_unknown_option_is_named_with_a_suggestion() -> None:
    with pytest.raises(
        ConfigError, match=r"inductor.options.max_autotun' = True: not an Inductor option.*max_autotune"
    ):
        validate_inductor_options({"max_autotun": True})


def test_option_type_and_forced_value_are_checked() -> None:
    with pytest.raises(ConfigError, match="true or false"):
        validate_inductor_options({"max_autotune": "yes"})
    with pytest.raises(ConfigError, match="always_keep_tensor_constants"):
        validate_inductor_options({"always_keep_tensor_constants": False})


def test_one_methods_options_are_checked_under_their_own_key() -> None:
    with pytest.raises(ConfigError, match=r"inductor.methods.decode.max_autotun' = True: not an Inductor option"):
        validate_inductor_options({"max_autotun": True}, key="inductor.methods.decode")


# module + checkpoint ----------------------------------------------------------


def test_instantiate_is_seeded_cast_and_in_eval_mode() -> None:
    spec = spec_of("+module=mlp", "target.dtype=float64")
    a, b = instantiate_module(spec), instantiate_module(spec)
    assert not a.training and a.fc1.weight.dtype == torch.float64
    assert torch.equal(a.fc1.weight, b.fc1.weight)


def test_nested_targets_build_a_transformers_model_from_its_config() -> None:
    model = instantiate_module(spec_of("+module=gpt2_tiny"))
    assert type(model).__name__ == "GPT2LMHeadModel"
    assert model.config.n_layer == 2 and model.config.vocab_size == 1000


def test_unimportable_target_is_a_config_error() -> None:
    from flashrt_build.stages.preflight import preflight

    with pytest.raises(ConfigError, match=r"module.model._target_' = 'nope.Missing': cannot be imported"):
        preflight(spec_of("+module=mlp", "module.model._target_=nope.Missing"))


@pytest.mark.parametrize(
    ("target", "said"),
    [
        ("flashrt_build.examples.MPL", "flashrt_build.examples has no 'MPL'; did you mean flashrt_build.examples.MLP?"),
        ("flashrt_build.exampels.MLP", "flashrt_build has no 'exampels'; did you mean flashrt_build.examples?"),
    ],
    ids=["class", "submodule"],
)
def test_a_misspelt_target_in_a_module_that_imports_is_told_the_closest_name(target: str, said: str) -> None:
    """Hydra's answer was 'No module named flashrt_build.examples.MPL; flashrt_build.examples is not a package'."""
    from flashrt_build.stages.preflight import preflight

    with pytest.raises(ConfigError) as info:
        preflight(spec_of("+module=mlp", f"module.model._target_={target}"))
    assert str(info.value) == f"config key 'module.model._target_' = '{target}': cannot be imported ({said})"


def test_a_target_whose_module_lacks_a_dependency_names_the_dependency(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The closest-name hint must not hide why a module did not import ('depmods has no net')."""
    from flashrt_build.stages.preflight import locate_target

    (tmp_path / "depmods").mkdir()
    (tmp_path / "depmods" / "__init__.py").write_text("")
    (tmp_path / "depmods" / "net.py").write_text("import not_installed_anywhere\n\nclass Net: ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as info:
        locate_target("depmods.net.Net")
    assert str(info.value).endswith(
        "cannot be imported (ModuleNotFoundError: No module named 'not_installed_anywhere')"
    )


def test_constructor_arguments_it_does_not_take_are_each_named_with_the_closest() -> None:
    """`hiden: 3` under module.model was an InstantiateError (exit 1) naming the first TypeError only."""
    with pytest.raises(ConfigError) as info:
        instantiate_module(spec_of("+module=mlp", "+module.model.hiden=3", "+module.model.colour=1"))
    assert [(p.key, p.value, p.expected) for p in info.value.problems] == [
        ("module.model.hiden", 3, "flashrt_build.examples.MLP takes no such argument; did you mean hidden?"),
        (
            "module.model.colour",
            1,
            "flashrt_build.examples.MLP takes no such argument; it takes in_features, hidden, out_features",
        ),
    ]
    assert info.value.exit_code == 2


def test_checkpoint_formats_read_the_same(tmp_path: Path) -> None:
    state = {"w": torch.arange(6.0).reshape(2, 3)}
    save_file(state, str(tmp_path / "a.safetensors"))
    torch.save(state, tmp_path / "b.pt")
    torch.save({"state_dict": state}, tmp_path / "c.ckpt")
    for name in ("a.safetensors", "b.pt", "c.ckpt"):
        assert torch.equal(read_checkpoint(tmp_path / name)["w"], state["w"])


def test_checkpoint_mismatch_counts_every_kind_naming_the_first(tmp_path: Path) -> None:
    module = torch.nn.Linear(3, 2)
    save_file({"weight": torch.zeros(2, 4), "extra": torch.zeros(1)}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ConfigError) as info:
        load_checkpoint(module, resolve_checkpoint("module.checkpoint", "bad", tmp_path / "bad.safetensors"))
    message = str(info.value)
    assert "1 missing: bias" in message and "1 unexpected: extra" in message
    assert "1 wrong: weight in bad.safetensors: shape [2, 4], the module's weight is [2, 3]" in message


def test_a_checkpoint_that_is_not_a_state_dict_is_refused(tmp_path: Path) -> None:
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="module.checkpoint"):
        read_checkpoint(tmp_path / "junk.pt")


# comparison -------------------------------------------------------------------


def test_compare_walks_every_leaf_of_a_model_output() -> None:
    ref = BaseModelOutput(last_hidden_state=torch.ones(2, 3), hidden_states=(torch.zeros(2), torch.ones(2)))
    out = BaseModelOutput(last_hidden_state=torch.ones(2, 3), hidden_states=(torch.zeros(2), torch.ones(2) * 2))
    leaves = compare_outputs(out, ref, None, None)
    assert len(leaves) == 3
    bad = [leaf for leaf in leaves if not leaf.passed]
    assert len(bad) == 1 and "hidden_states" in bad[0].path and bad[0].max_abs_err == 1.0


def test_relative_error_is_a_norm_ratio_and_tolerances_apply() -> None:
    ref = torch.tensor([3.0, 4.0])
    (leaf,) = compare_outputs(ref + torch.tensor([0.0, 0.5]), ref, atol=0.1, rtol=0.2)
    assert leaf.max_abs_err == 0.5 and math.isclose(leaf.rel_err, 0.1)
    assert leaf.passed  # within rtol although beyond atol
    (leaf,) = compare_outputs(ref + torch.tensor([0.0, 0.5]), ref, atol=0.1, rtol=0.05)
    assert not leaf.passed


def test_nan_where_eager_has_none_fails() -> None:
    (leaf,) = compare_outputs(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 2.0]), 1e9, 1e9)
    assert not leaf.passed and leaf.max_abs_err == math.inf
    (leaf,) = compare_outputs(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, float("nan")]), 0, 0)
    assert leaf.passed


def test_an_output_without_finite_values_is_reported_not_passed() -> None:
    """All-NaN outputs used to pass with a recorded error of 0.0: nothing was compared."""
    nan = torch.full((2, 3), float("nan"))
    (leaf,) = compare_outputs(nan.clone(), nan, 1e9, 1e9)
    assert not leaf.passed and leaf.compared == 0 and leaf.nothing_compared
    with pytest.raises(VerifyError, match="package output output has no finite values to compare at call 'x'"):
        raise_on_mismatch([leaf], "call 'x'")
    (allowed,) = compare_outputs(nan.clone(), nan, 1e9, 1e9, allow_nonfinite=True)
    assert allowed.passed and allowed.compared == 0  # the config said so, and the package agrees
    (differs,) = compare_outputs(torch.zeros(2, 3), nan, 1e9, 1e9, allow_nonfinite=True)
    assert not differs.passed  # NaN where the package has numbers is still a mismatch
    (partly,) = compare_outputs(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, float("nan")]), 0, 0)
    assert partly.passed and partly.compared == 1
    (empty,) = compare_outputs(torch.zeros(0, 3), torch.zeros(0, 3), 0, 0)
    assert empty.passed and not empty.nothing_compared


def test_a_large_leaf_is_compared_slice_by_slice_as_exactly_as_whole() -> None:
    """An LLM's logits are gigabytes in float64 at once; the slices give the same errors."""
    from flashrt_build.stages.compare import _CHUNK, _errors_where_all_finite, compare_leaves

    ref = torch.randn(3, _CHUNK // 2 + 7)  # more than two slices, the last one short
    out = ref + 1e-4 * torch.randn_like(ref)
    max_abs, rel, count = _errors_where_all_finite(out, ref)
    whole = out.double() - ref.double()
    assert max_abs == float(whole.abs().max()) and count == ref.numel()
    assert math.isclose(rel, float(whole.norm()) / float(ref.double().norm()), rel_tol=1e-9)
    for bad in (math.nan, math.inf):
        broken = out.clone()
        broken[2, -1] = bad
        assert _errors_where_all_finite(broken, ref) is None  # left to the comparison that places non-finites
        assert not compare_leaves([broken], ref, None, None)[0].passed


def test_constant_leaves_compare_by_value_and_type() -> None:
    leaves = compare_outputs((torch.ones(1), None, 3), (torch.ones(1), None, 3), 0, 0)
    assert [leaf.passed for leaf in leaves] == [True, True, True]
    assert json.dumps([leaf.to_json() for leaf in leaves])  # a manifest can hold the record
    (_, _, three) = compare_outputs((torch.ones(1), None, torch.tensor(3)), (torch.ones(1), None, 3), 0, 0)
    assert not three.passed  # a tensor is not the int eager returned


def test_eager_raising_during_verification_names_the_call() -> None:
    import modules

    spec = spec_of("+module=mlp")
    calls = plan_calls(spec, repeat=0)
    with pytest.raises(VerifyError, match=r"the eager forward of .* raised RuntimeError at call 'example', so there"):
        run_eager(modules.RaisesInForward(), spec, calls, [])


def test_where_a_verification_process_stopped(tmp_path: Path) -> None:
    calls = plan_calls(spec_of("+module=mlp"), repeat=0)
    assert _where(tmp_path, calls) is None  # it never started
    (tmp_path / "progress").write_text("loading")
    assert _where(tmp_path, calls) is None  # loading: the toolchain is the usual suspect
    (tmp_path / "progress").write_text("call 2")
    assert _where(tmp_path, calls) == "call 'batch=33' (x [33, 16])"
    said = (
        "terminate called after throwing an instance of 'c10::Error'\n  what():  index out of bounds: 0 <= tmp2 < 10\n"
    )
    assert _what(said) == "what(): index out of bounds: 0 <= tmp2 < 10"
    # Two threads aborting at once: the line holds another thread's words, not the message.
    interleaved = "terminate called after throwing an instance of 'c10::Error'\n"
    interleaved += "  what():  terminate called recursively\n"
    assert _what(interleaved) is None


def test_a_call_the_package_refused_is_named_in_its_own_words() -> None:
    """AOTInductor's runtime prints the exception; Python hears only that the call failed."""
    stderr = "warming up\nError: CUDA error: an illegal memory access was encountered\nlater noise\n"
    assert _package_said(stderr) == "CUDA error: an illegal memory access was encountered"
    assert _package_said("run_func_( ... ) API call failed at model_container_runner.cpp\n") is None
    # an ATen operator's check (an H100's, verbatim) says more than the call that failed
    stderr = (
        "[E1206 06:45:53.386160039 c_shim_cuda.cpp:431] Exception in aoti_torch: self.size(0) needs to be greater "
        "than 16, but got 8\nframe #0: c10::Error::Error(...)\nError: aoti_torch_cuda__int_mm_out(buf5, ...) API "
        "call failed at wrapper.cpp, line 2546\n"
    )
    assert _package_said(stderr) == "self.size(0) needs to be greater than 16, but got 8"


def test_structure_and_shape_mismatches_fail() -> None:
    with pytest.raises(VerifyError, match="output structure"):
        compare_outputs((torch.ones(1),), [torch.ones(1)], None, None)
    (leaf,) = compare_outputs(torch.ones(2), torch.ones(3), None, None)
    assert not leaf.passed


def test_default_tolerances_are_looser_for_half_precision() -> None:
    assert tolerances(torch.float32, None, None) < tolerances(torch.bfloat16, None, None)
    assert tolerances(torch.float16, 0.5, None) == (0.5, tolerances(torch.float16, None, None)[1])


def test_tensor_sha256_covers_bytes_dtype_agnostic() -> None:
    a = torch.arange(4, dtype=torch.bfloat16)
    assert tensor_sha256(a) == tensor_sha256(a.clone()) != tensor_sha256(a + 1)
    assert tensor_sha256(torch.zeros(2, 2).t()) == tensor_sha256(torch.zeros(2, 2))


@pytest.mark.slow
def test_constant_keyword_arguments_are_bound_so_dynamic_dims_still_export() -> None:
    """`return_dict=False` or `output_hidden_states=True` on bert_tiny failed
    with torch's "Must provide a tree_name": the dynamic-shape spec did not
    match the call's keywords. They are bound into the exported method now."""
    spec = spec_of("+module=bert_tiny", "+module.kwargs.output_hidden_states=true", "+module.kwargs.return_dict=false")
    module = instantiate_module(spec)
    example = make_inputs(spec)
    program = export_module(module, spec, example, dynamic_shapes(spec, example)).program
    assert program.call_spec.in_spec.children_specs[1].context == ["input_ids", "attention_mask"]  # tensors only
    ids, mask = (torch.ones(2, 70, dtype=torch.int64) for _ in range(2))  # another length: the seq dim is dynamic
    out = program.module()(input_ids=ids, attention_mask=mask)
    with torch.no_grad():
        want = module(input_ids=ids, attention_mask=mask, output_hidden_states=True, return_dict=False)
    assert isinstance(out, tuple) and len(out) == len(want) == 3  # hidden, pooled, all hidden states
    torch.testing.assert_close(out[0], want[0])
    assert "state_dict" not in type(module).__dict__ and "forward" not in module.__dict__  # nothing left patched


SHIPPED = sorted(p.stem for p in (CONF_DIR / "module").glob("*.yaml"))


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_config_instantiates(name: str, tmp_path: Path) -> None:
    """Every target of every shipped config is importable here (torchvision's
    resnet50 included: it is pinned) and builds a module; the big ones on the
    meta device, which allocates nothing."""
    from hydra.utils import instantiate

    from flashrt_build.examples import save_gpt2_tiny
    from flashrt_build.stages.preflight import check_targets

    overrides = [f"+module={name}"]
    if name == "pretrained_gpt2":
        save_gpt2_tiny(str(tmp_path / "gpt2"))
        overrides.append(f"module.model.pretrained_model_name_or_path={tmp_path / 'gpt2'}")
    if name == "causal_lm":
        from llm_families import save_family

        overrides.append(f"module.pretrained={save_family('llama', tmp_path / 'llama')}")
    spec = resolve_spec(compose(overrides))
    check_targets(spec)  # located as Hydra will, every nested one too
    if name in ("pretrained_gpt2", "causal_lm"):
        module = instantiate_module(spec)
    else:
        with torch.device("meta"):
            module = instantiate(dict(spec.model), _convert_="all")
    assert isinstance(module, torch.nn.Module) and sum(p.numel() for p in module.parameters()) > 0
