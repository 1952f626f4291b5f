"""One package, several entry points, one weight set: the zoo's decoder LM
(prefill + decode over a static KV cache) and T5 (encode + decode), each
built once per session."""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import pytest
import torch
from omegaconf import OmegaConf
from safetensors import safe_open

import flashrt_build
import flashrt_build.stages.compile as compiled
from flashrt_build.config.compose import as_build_config, compose
from flashrt_build.config.spec import resolve_spec
from flashrt_build.errors import ConfigError, ExportError
from flashrt_build.stages.module import instantiate_module

TESTS = Path(__file__).resolve().parents[1]


def build(*overrides: str, output_dir: Path) -> flashrt_build.BuildResult:
    return flashrt_build.build(compose([*overrides, f"output_dir={output_dir}", f"output_root={output_dir.parent}"]))


@pytest.fixture(scope="session")
def t5_build(tmp_path_factory: pytest.TempPathFactory) -> flashrt_build.BuildResult:
    return build("+module=t5_tiny", output_dir=tmp_path_factory.mktemp("t5") / "baked")


def eager(*overrides: str) -> torch.nn.Module:
    return instantiate_module(resolve_spec(compose(list(overrides))))


@pytest.mark.slow
def test_the_lm_is_one_package_of_two_methods_over_one_weight_set(lm_build: flashrt_build.BuildResult) -> None:
    manifest = lm_build.manifest
    assert {name: (m["method"], m["model"], m["state"]) for name, m in manifest["methods"].items()} == {
        "prefill": ("forward", "prefill", ["kv_cache"]),
        "decode": ("decode", "decode", ["kv_cache"]),
    }
    tensors = manifest["weights"]["tensors"]
    # both bind every weight by the module's own names, like the sidecar; the cache is state, not a weight
    assert all(t["methods"] == {"prefill": t["fqn"], "decode": t["fqn"]} for t in tensors)
    assert "kv_cache" not in {t["fqn"] for t in tensors}
    with safe_open(str(lm_build.output_dir / "weights.safetensors"), framework="pt") as sidecar:
        assert sorted(sidecar.keys()) == sorted(t["fqn"] for t in tensors)  # each tensor once
        data = sum(sidecar.get_tensor(k).nbytes for k in sidecar.keys())  # noqa: SIM118
    module = eager("+module=tiny_lm")
    assert data == sum(p.nbytes for p in module.parameters())
    assert manifest["state"]["tensors"][0]["fqn"] == "kv_cache" and manifest["inputs"][0]["name"] == "input_ids"
    labels = [p["label"] for p in manifest["verification"]["probes"]]
    assert labels[:2] == ["prefill: example", "prefill: prompt=2"] and "decode: example" in labels
    assert labels[-5:] == [
        "chain 1: prefill",
        "chain 2: decode",
        "chain 3: decode",
        "chain 4: decode",
        "chain 5: decode",
    ]
    assert manifest["verification"]["passed"] is True


@pytest.mark.slow
def test_prefill_then_decode_matches_eager_call_by_call(lm_build: flashrt_build.BuildResult) -> None:
    lm, reference = flashrt_build.load(lm_build.output_dir), eager("+module=tiny_lm")
    prompt = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        torch.testing.assert_close(lm(prompt), reference(prompt))  # m(...) is the forward: prefill
        for position in range(12, 16):  # each token reads what the calls before wrote
            token = torch.randint(0, 256, (1, 1), generator=torch.Generator().manual_seed(position))
            step = torch.tensor([position])
            torch.testing.assert_close(lm.decode(token, step), reference.decode(token, step))
        torch.testing.assert_close(lm.state["kv_cache"], reference.kv_cache)
        # decode after a prefill continues it: the last logits of one longer prefill
        whole = torch.cat([prompt, torch.tensor([[3]])], dim=1)
        lm.prefill(prompt)
        torch.testing.assert_close(lm.decode(torch.tensor([[3]]), torch.tensor([12]))[:, 0], lm(whole)[:, 12])


@pytest.mark.slow
def test_two_methods_read_one_copy_of_a_weight(lm_build: flashrt_build.BuildResult) -> None:
    """Bound to the eager module's tensors, both methods read that storage:
    zeroing the head in place zeroes both methods' logits."""
    host = eager("+module=tiny_lm")
    lm = flashrt_build.load(lm_build.output_dir, host=host)
    prompt, token, position = torch.randint(0, 256, (1, 5)), torch.tensor([[1]]), torch.tensor([5])
    with torch.no_grad():
        assert lm(prompt).abs().sum() > 0 and lm.decode(token, position).abs().sum() > 0
        host.head.weight.zero_()
        assert lm(prompt).abs().sum() == 0 and lm.decode(token, position).abs().sum() == 0
    assert lm.decode is lm.methods["decode"] and lm.head is host.head  # methods by name; the rest falls through


@pytest.mark.slow
def test_t5_encode_then_decode_matches_eager(t5_build: flashrt_build.BuildResult) -> None:
    t5, reference = flashrt_build.load(t5_build.output_dir), eager("+module=t5_tiny")
    source = torch.randint(0, 256, (2, 9))
    target = torch.randint(0, 256, (2, 4))
    with torch.no_grad():
        states = t5.encode(source)
        torch.testing.assert_close(states, reference.encode(source))
        torch.testing.assert_close(t5.decode(target, states), reference(source, target))
        torch.testing.assert_close(t5(source), states)  # no method runs forward: m(...) is the first, encode
    weights = t5_build.manifest["weights"]
    assert weights["mode"] == "baked" and weights["copies"] == 2  # each method's model holds its own
    tied = next(t for t in weights["tensors"] if "t5.shared.weight" in t.get("aliases", []))
    assert set(tied["methods"]) == {"encode", "decode"}  # the tied embedding: one entry, both methods


@pytest.mark.slow
def test_changing_one_methods_inputs_recompiles_that_method_only(lm_build: flashrt_build.BuildResult) -> None:
    out = lm_build.output_dir.parent / "decode-changed"
    with mock.patch.object(compiled, "compile_package", wraps=compiled.compile_package) as compiler:
        changed = build(
            "+module=tiny_lm", "weights=external", "module.methods.decode.inputs.position.low=20", output_dir=out
        )
    assert compiler.call_count == 1 and "method decode" in compiler.call_args.args[3]
    assert {n: m["compiled"] for n, m in changed.manifest["methods"].items()} == {
        "prefill": "reused",
        "decode": "built",
    }
    assert changed.manifest["methods"]["prefill"]["method_key"] == lm_build.manifest["methods"]["prefill"]["method_key"]
    assert changed.manifest["verification"]["passed"] is True


@pytest.mark.slow
def test_options_for_one_method_compile_that_method_only(lm_build: flashrt_build.BuildResult) -> None:
    """`inductor.methods.decode` tunes decode alone: prefill keeps the default options, so its model is reused."""
    out = lm_build.output_dir.parent / "decode-profile"
    with mock.patch.object(compiled, "compile_package", wraps=compiled.compile_package) as compiler:
        tuned = build(
            "+module=tiny_lm",
            "weights=external",
            "+inductor.methods.decode={coordinate_descent_tuning: true, coordinate_descent_check_all_directions: true}",
            output_dir=out,
        )
    assert compiler.call_count == 1 and "method decode" in compiler.call_args.args[3]
    profile = {"coordinate_descent_tuning": True, "coordinate_descent_check_all_directions": True}
    assert profile.items() <= compiler.call_args.args[1].items()  # what the compile was given
    methods = tuned.manifest["methods"]
    assert profile.items() <= methods["decode"]["inductor_options"].items()
    assert "coordinate_descent_tuning" not in {
        **methods["prefill"]["inductor_options"],
        **tuned.manifest["inductor"]["options"],
    }
    assert (
        methods["prefill"]["compiled"] == "reused"
        and methods["decode"]["method_key"] != (lm_build.manifest["methods"]["decode"]["method_key"])
    )
    assert tuned.manifest["verification"]["passed"] is True


def test_a_graph_break_in_one_method_fails_the_build_naming_it(tmp_path: Path) -> None:
    conf = tmp_path / "conf" / "module"
    conf.mkdir(parents=True)
    (conf / "two.yaml").write_text(
        "name: two\nmodel: {_target_: modules.BranchyMethod}\n"
        "methods:\n  forward: {inputs: {x: {shape: [2, 4]}}}\n  branchy: {inputs: {x: {shape: [2, 4]}}}\n"
    )
    cfg = compose(["+module=two", f"output_root={tmp_path / 'out'}"], config_dir=tmp_path / "conf")
    with pytest.raises(ExportError, match="could not capture modules.BranchyMethod method branchy as one graph"):
        flashrt_build.build(cfg)
    assert not (tmp_path / "out" / "two").exists()


def lm_config(**module: object) -> dict:
    """tiny_lm's composed config with `module` keys replaced: new dict
    entries, which command-line overrides cannot add to a typed node."""
    config = OmegaConf.to_container(compose(["+module=tiny_lm"]))
    config["module"].update(module)
    return config


@pytest.mark.parametrize(
    ("config", "key", "needle"),
    [
        (
            compose(["+module=tiny_lm", "module.methods.decode.inputs.position.shape=[0]"]),
            "module.methods.decode.inputs.position.shape",
            "positive",
        ),
        (lm_config(inputs={"x": {"shape": [1]}}), "module.inputs", "give each method's inputs there"),
        (
            lm_config(methods={"state": {"inputs": {"x": {"shape": [1]}}}}),
            "module.methods.state",
            "a LoadedModule attribute",
        ),
        (
            compose(["+module=tiny_lm", "module.methods.decode.method=decod"]),
            "module.methods.decode.method",
            "TinyLM has no such method",
        ),
    ],
    ids=["bad-shape", "inputs-and-methods", "reserved-name", "no-such-method"],
)
def test_method_errors_name_the_method_and_key(config: object, key: str, needle: str) -> None:
    from flashrt_build.stages.preflight import preflight

    with pytest.raises(ConfigError) as info:
        spec = resolve_spec(as_build_config(config))
        preflight(spec)
        instantiate_module(spec)
    problems = getattr(info.value, "problems", [info.value])
    assert any(p.key == key and needle in str(p) for p in problems), str(info.value)


def test_a_module_without_methods_is_one_forward_as_before() -> None:
    spec = resolve_spec(compose(["+module=mlp"]))
    assert [(m.name, m.attr, m.model) for m in spec.methods] == [("forward", "forward", "model")]
    assert not spec.multi_method and spec.inputs == spec.methods[0].inputs


def test_manifests_without_methods_still_load_as_one_forward(tmp_path: Path) -> None:
    from flashrt_build.runtime.manifest import manifest_methods

    old = {"inputs": [{"name": "x"}], "outputs": [], "config": {"module": {"kwargs": {"k": 1}}}, "state": None}
    assert manifest_methods(old) == {
        "forward": {
            "method": "forward",
            "model": "model",
            "inputs": [{"name": "x"}],
            "outputs": [],
            "kwargs": {"k": 1},
            "state": [],
        }
    }
    json.dumps(old)


@pytest.mark.parametrize("name", ["training", "default_method", "zero_grad", "named_parameters", "bound_weights"])
def test_an_entry_point_named_like_a_loaded_packages_attribute_is_refused(name: str) -> None:
    """The hand-copied list of reserved names missed these: such a method was silently shadowed."""
    from flashrt_build.stages.preflight import preflight

    with pytest.raises(ConfigError) as info:
        decode = {"method": "decode", "inputs": {"input_ids": {"shape": [1, 1], "dtype": "int64"}}}
        preflight(resolve_spec(as_build_config(lm_config(methods={name: decode}))))
    assert f"module.methods.{name}" in str(info.value) and "LoadedModule attribute" in str(info.value)


@pytest.mark.slow
def test_every_attribute_of_a_loaded_package_is_a_reserved_name(lm_build: flashrt_build.BuildResult) -> None:
    """Derived from LoadedModule itself: no attribute of a real loaded package escapes the check."""
    from flashrt_build.runtime.load import attribute_names

    loaded = flashrt_build.load(lm_build.output_dir)
    own = set(dir(loaded)) - set(loaded.methods)  # the entry points themselves are reached through __getattr__
    assert own <= attribute_names()
