"""Config composition and validation: pure logic, nothing is compiled."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from pathlib import Path

import pytest
from clitools import mounted

from flashrt_build.config.compose import CONF_DIR, as_build_config, compose
from flashrt_build.config.schema import PASS_SWITCHES, WeightsMode
from flashrt_build.config.spec import flatten_options, resolve_spec
from flashrt_build.errors import ConfigError

SHIPPED = sorted(p.stem for p in (CONF_DIR / "module").glob("*.yaml"))


def user_module(conf_dir: Path, inputs: str) -> Path:
    """A user's own module config `mine` in `conf_dir`, as `--config-dir` expects."""
    (conf_dir / "module").mkdir(exist_ok=True)
    (conf_dir / "module" / "mine.yaml").write_text(
        f"name: mine\nmodel: {{_target_: torch.nn.Identity}}\ninputs: {inputs}\n"
    )
    return conf_dir


def spec_of(*overrides: str, cwd: Path | None = None):
    return resolve_spec(compose(["+module=mlp", *overrides]), cwd)


def config_error(*overrides: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        spec_of(*overrides)
    return info.value


def test_shipped_modules_are_the_documented_ones() -> None:
    assert {"mlp", "gpt2_tiny", "bert_tiny"} <= set(SHIPPED)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A save_pretrained directory for causal_lm: a 2-layer Llama, a tokenizer's config beside it."""
    import transformers

    path = tmp_path_factory.mktemp("llama")
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=300, max_position_embeddings=10000,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    (path / "tokenizer_config.json").write_text("{}")
    return path


@pytest.mark.parametrize("name", SHIPPED)
@pytest.mark.parametrize("target", ["cpu", "cuda"])
@pytest.mark.parametrize("weights", ["baked", "external"])
def test_every_shipped_config_composes_and_validates(name: str, target: str, weights: str, pretrained: Path) -> None:
    extra = [f"module.pretrained={pretrained}"] if name == "causal_lm" else []
    spec = resolve_spec(compose([f"+module={name}", f"target={target}", f"weights={weights}", *extra]))
    folder = pretrained.name if extra else name  # causal_lm's is named after the model's directory
    assert spec.name == folder
    assert spec.weights is WeightsMode(weights)
    assert spec.inputs and all(all(n > 0 for n in i.shape) for i in spec.inputs)
    assert spec.output_dir.parts[-2:] == (folder, f"{target}-{weights}-default")


def test_causal_lm_reads_its_sizes_from_the_directory_and_caps_the_cache(pretrained: Path) -> None:
    spec = resolve_spec(compose(["+module=causal_lm", f"module.pretrained={pretrained}"]))
    prefill, decode = spec.methods
    (ids,) = prefill.inputs
    assert (ids.high, ids.shape, ids.dynamic[1].min, ids.dynamic[1].max) == (300, (1, 8), 1, 4096)
    assert [(i.name, i.shape, i.high) for i in decode.inputs] == [("input_ids", (1, 1), 300), ("position", (1,), 4096)]
    assert spec.config["module"]["model"]["max_cache_len"] == 4096  # 10000 positions, capped
    assert spec.checkpoint is None  # transformers loads the directory's weights; each file is an input of the key
    assert {f.name for f in spec.input_files if f.key == "module.model.pretrained"} >= {
        "config.json",
        "model.safetensors",
    }
    served = [(f.key, f.name, f.kind) for f in spec.input_files if f.key == "module.files"]
    assert served == [
        ("module.files", "generation_config.json", "weights"),
        ("module.files", "tokenizer_config.json", "weights"),
    ]
    small = resolve_spec(compose(["+module=causal_lm", f"module.pretrained={pretrained}", "module.max_cache_len=64",
                                  "module.max_prompt=4", "module.batch=2"]))  # fmt: skip
    (ids,) = small.methods[0].inputs
    assert (ids.shape, ids.dynamic[1].max) == ((2, 4), 4)
    assert [i.shape for i in small.methods[1].inputs] == [(2, 1), (2,)] and small.methods[1].inputs[1].high == 64
    with pytest.raises(ConfigError, match=r"'module.pretrained' = .*holds no config.json"):
        resolve_spec(compose(["+module=causal_lm", f"module.pretrained={pretrained.parent}"]))


def test_mlp_spec_resolves_types_and_dynamic_dims() -> None:
    spec = spec_of()
    (x,) = spec.inputs
    assert (x.name, x.shape, x.dtype) == ("x", (4, 16), "float32")
    assert x.dynamic[0].name == "batch" and (x.dynamic[0].min, x.dynamic[0].max) == (1, 64)
    assert spec.target == "flashrt_build.examples.MLP"
    assert (spec.device, spec.dtype) == ("cpu", "float32")


def test_each_pass_switch_is_read_once_into_the_spec_and_any_pass() -> None:
    """The `passes` group's switches (schema.PassesConfig) are the spec's and
    `any_pass`'s: a switch the schema adds without a spec field fails here."""
    spec = spec_of("passes=llm")
    on = {switch for switch in PASS_SWITCHES if getattr(spec, switch)}
    assert on and set(PASS_SWITCHES) - on  # llm turns some on, not all
    assert set(PASS_SWITCHES) <= {f.name for f in fields(spec)}
    assert spec.any_pass and not spec_of().any_pass
    assert spec_of("passes.pdl=true").any_pass


def test_bert_shares_one_sequence_dim() -> None:
    spec = resolve_spec(compose(["+module=bert_tiny"]))
    assert {i.dynamic[1].name for i in spec.inputs} == {"seq"}
    assert spec.inputs[0].low == 0 and spec.inputs[0].high == 1000


def test_dtype_aliases_are_canonical() -> None:
    assert spec_of("target.dtype=bf16").dtype == "bfloat16"


def test_no_module_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"module.*\+module=NAME"):
        resolve_spec(compose([]))


def test_unknown_module_name_is_rejected_listing_the_options() -> None:
    with pytest.raises(ConfigError, match="config group 'module' = 'nope': no such module config; choices: .*mlp"):
        compose(["+module=nope"])


@pytest.mark.parametrize(("target", "meant"), [("gpu", "cuda"), ("GPU", "cuda"), ("cdua", "cuda"), ("cpus", "cpu")])
def test_a_target_by_another_name_or_misspelt_is_told_the_shipped_one(target: str, meant: str) -> None:
    """`target=gpu` was answered 'did you mean cpu?': nearest by spelling, the opposite of what was meant."""
    with pytest.raises(ConfigError, match=rf"'target' = '{target}': no such target config; .*did you mean {meant}\?$"):
        compose(["+module=mlp", f"target={target}"])


def test_unknown_key_is_rejected_at_composition() -> None:
    with pytest.raises(ConfigError, match="'module.inputs.x.colour' = 'red': not a config key; valid keys under"):
        compose(["+module=mlp", "module.inputs.x.colour=red"])


def test_unknown_key_in_a_user_module_file_is_rejected(tmp_path: Path) -> None:
    user_module(tmp_path, "{x: {shape: [2], colour: red}}")
    with pytest.raises(ConfigError, match=r"'module.inputs.x.colour' = .*not a config key.*\(in module/mine.yaml\)"):
        compose(["+module=mine"], config_dir=tmp_path)


def test_user_config_dir_adds_modules(tmp_path: Path) -> None:
    user_module(tmp_path, "{x: {shape: [2, 3]}}")
    spec = resolve_spec(compose(["+module=mine"], config_dir=tmp_path))
    assert spec.target == "torch.nn.Identity" and spec.inputs[0].shape == (2, 3)


def test_wrong_type_is_rejected_at_composition() -> None:
    with pytest.raises(ConfigError) as info:
        compose(["+module=mlp", "seed=abc"])
    assert info.value.key == "seed" and info.value.value == "abc" and "converted to Integer" in str(info.value)


def test_weights_mode_is_an_enum() -> None:
    with pytest.raises(ConfigError, match="'weights' = 'sideways': Invalid value 'sideways', expected one of"):
        compose(["+module=mlp", "weights=sideways"])


@pytest.mark.parametrize(
    ("overrides", "key", "needle"),
    [
        (["module.inputs.x.dtype=float33"], "module.inputs.x.dtype", "dtype name"),
        (["target.dtype=int64"], "target.dtype", "float dtype"),
        (["module.inputs.x.shape=[0,16]"], "module.inputs.x.shape", "positive"),
        (["module.inputs.x.shape=[-2,16]"], "module.inputs.x.shape", "positive"),
        (["module.inputs.x.dynamic={0: {min: 8, max: 2}}"], "module.inputs.x.dynamic.0", "min <= max"),
        (["module.inputs.x.shape=[100,16]"], "module.inputs.x.shape", "outside its dynamic range"),
        (["module.checkpoint=/nonexistent/ckpt.safetensors"], "module.checkpoint", "no such file"),
        (["target.device=tpu"], "target.device", "cpu"),
        (["module.name=../escape"], "module.name", "letters"),
        (["verify.atol=-1"], "verify.atol", ">= 0"),
    ],
)
def test_bad_values_name_the_key_and_value(overrides: list[str], key: str, needle: str) -> None:
    err = config_error(*overrides)
    assert err.key == key
    assert needle in str(err)


def test_dynamic_axis_must_exist(tmp_path: Path) -> None:
    user_module(tmp_path, "{x: {shape: [2, 3], dynamic: {5: {min: 1, max: 4}}}}")
    with pytest.raises(ConfigError, match=r"module.inputs.x.dynamic' = 5: expected an integer axis in \[0, 2\)"):
        resolve_spec(compose(["+module=mine"], config_dir=tmp_path))


def test_all_problems_are_reported_at_once() -> None:
    err = config_error("module.inputs.x.dtype=float33", "target.device=tpu")
    assert "the config has 2 errors" in str(err) and len(err.problems) == 2
    assert "module.inputs.x.dtype" in str(err) and "target.device" in str(err)


def test_shared_dim_names_must_agree() -> None:
    with pytest.raises(ConfigError, match="dim 'seq' must match"):
        resolve_spec(
            compose(["+module=bert_tiny", "module.inputs.attention_mask.dynamic={1: {name: seq, min: 2, max: 64}}"])
        )


def test_low_high_only_for_integer_inputs() -> None:
    assert config_error("+module.inputs.x.low=0").key == "module.inputs.x.low"


def test_output_dir_is_derived_from_choices_never_a_timestamp(tmp_path: Path) -> None:
    spec = spec_of("weights=external", "inductor=max_autotune", "output_root=builds", cwd=tmp_path)
    assert spec.output_dir == tmp_path / "builds" / "mlp" / "cpu-external-max_autotune"
    assert (
        spec_of("variant=target.dtype_bfloat16", cwd=tmp_path).output_dir.name
        == "cpu-baked-default-target.dtype_bfloat16"
    )


def test_output_dir_override_is_exact(tmp_path: Path) -> None:
    assert spec_of(f"output_dir={tmp_path / 'x'}").output_dir == tmp_path / "x"
    assert spec_of("output_dir=rel/dir", cwd=tmp_path).output_dir == tmp_path / "rel" / "dir"


def test_variants_of_one_sweep_get_distinct_dirs() -> None:
    def variant(*overrides: str) -> str | None:
        return compose(["+module=mlp", *overrides]).variant

    assert variant("target.dtype=bfloat16") == "target.dtype_bfloat16"
    assert variant("target.dtype=float32") is None  # the target file's own value: no variant
    assert variant("target=cpu", "weights=external", "output_root=x", "verify.atol=1", "seed=0") is None
    assert variant("module.checkpoint=/a/b.safetensors") == "ckpt_b"
    assert variant("release=true", "allowed_targets=[mymodels.*]", "threads=2") == "release_true"


def test_inductor_options_are_flattened() -> None:
    assert flatten_options({"cpp": {"march": "x86-64-v3"}, "max_autotune": True}) == {
        "cpp.march": "x86-64-v3",
        "max_autotune": True,
    }
    spec = spec_of("+inductor.options.cpp={march: x86-64-v3}")
    assert spec.inductor_options == {"cpp.march": "x86-64-v3"}


def test_options_for_one_method_name_a_method_of_the_module() -> None:
    decode = "+inductor.methods.decode.coordinate_descent_tuning=true"
    spec = resolve_spec(compose(["+module=tiny_lm", decode]))
    assert spec.method_inductor_options["decode"]["coordinate_descent_tuning"] is True
    assert "coordinate_descent_tuning" not in spec.inductor_options and "prefill" not in spec.method_inductor_options
    with pytest.raises(
        ConfigError, match=r"inductor.methods.decode' = .*not a method of this module; its methods: forward"
    ):
        spec_of(decode)  # the mlp has one method, its forward


def test_allowed_targets_refuse_other_targets_before_import() -> None:
    err = config_error("allowed_targets=[transformers.*]")
    assert err.key == "module.model._target_" and err.value == "flashrt_build.examples.MLP"
    assert "allowed_targets" in str(err)
    assert spec_of("allowed_targets=[flashrt_build.*]").target == "flashrt_build.examples.MLP"
    # nested targets are checked too: a transformers model built from its config
    with pytest.raises(ConfigError, match=r"module.model.config._target_' = 'transformers.GPT2Config'"):
        resolve_spec(compose(["+module=gpt2_tiny", "allowed_targets=[transformers.GPT2LMHeadModel]"]))
    # never imported: an unimportable target is refused by the allow-list, not by import
    assert config_error("allowed_targets=[x.*]", "module.model._target_=evil.payload.Run").value == "evil.payload.Run"


def test_release_allows_the_shipped_zoo_plus_user_patterns() -> None:
    assert resolve_spec(compose(["+module=gpt2_tiny", "release=true"])).target == "transformers.GPT2LMHeadModel"
    err = config_error("release=true", "module.model._target_=mycompany.Net")
    assert "a release build (release=true) admits only the shipped configs' targets" in str(err)
    assert "add allowed_targets=[mycompany.Net]" in str(err)
    widened = resolve_spec(
        compose(["+module=mlp", "release=true", "allowed_targets=[mycompany.*]", "module.model._target_=mycompany.Net"])
    )
    assert widened.target == "mycompany.Net"


@pytest.mark.parametrize(
    ("override", "key", "hint"),
    [
        ("+no_such_key=1", "no_such_key", "not a config key; valid keys: allowed_targets, force, inductor, module"),
        (
            "+inductr.options.max_autotune=true",
            "inductr.options.max_autotune",
            "did you mean inductor.options.max_autotune?",
        ),
        (
            "+module.inputs.x.dynamc={0: {min: 1, max: 8}}",
            "module.inputs.x.dynamc.0",
            "did you mean module.inputs.x.dynamic.0?",
        ),
        ("++verify.repet=2", "verify.repet", "did you mean verify.repeat?"),
        ("+target.devise=cuda", "target.devise", "did you mean target.device?"),
        (
            "++verify.zzz=1",
            "verify.zzz",
            "valid keys under verify: allow_nonfinite, atol, bench, enabled, repeat, rtol, timeout",
        ),
    ],
)
def test_a_key_the_schema_lacks_is_refused_naming_the_closest_valid_key(override: str, key: str, hint: str) -> None:
    error = config_error(override)
    assert error.key == key and hint in str(error)
    assert str(error).count("\n") == 0  # one line


def test_unknown_keys_are_reported_together_and_before_anything_else() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_spec(compose(["+bogus=1", "++seeed=2"]))  # no module either: the typos come first
    assert [p.key for p in info.value.problems] == ["bogus", "seeed"]
    assert "did you mean seed?" in str(info.value)


def test_free_form_places_take_any_key() -> None:
    spec = spec_of("+module.model.extra_arg=1", "+module.kwargs.flag=true", "+inductor.options.max_autotune=true")
    assert spec.model["extra_arg"] == 1 and spec.kwargs["flag"] is True
    assert spec.inductor_options["max_autotune"] is True  # checked against Inductor's own config later


def test_a_free_form_key_without_plus_is_told_to_add_it_with_plus() -> None:
    """`inductor.options.max_autotune=true` (a key new to the config, without `+`) was answered
    'did you mean inductor.options.max_autotune?'; a typo above a key named only the part it hit, = '?'."""
    for key, value in (("inductor.options.max_autotune", "true"), ("module.kwargs.flag", "1")):
        with pytest.raises(ConfigError) as info:
            compose(["+module=mlp", f"{key}={value}"])
        assert str(info.value) == (
            f"config key '{key}' = '{value}': not in the config yet; a new key is added with '+': +{key}={value}"
        )
        compose(["+module=mlp", f"+{key}={value}"])  # as it says
    with pytest.raises(ConfigError) as info:
        compose(["+module=mlp", "inductor.option.max_autotune=true"])
    assert str(info.value) == (
        "config key 'inductor.option.max_autotune' = 'true': not a config key; "
        "did you mean inductor.options.max_autotune?"
    )


def test_a_dotted_key_through_an_axis_is_told_the_override_that_reaches_it() -> None:
    """`module.inputs.x.dynamic.0.max=8` found nothing (Hydra reads the 0 as text, the YAML's axis is a
    number) and was told to add the key with '+', which fails too; the merge it is told now works."""
    for override in ("module.inputs.x.dynamic.0.max=8", "+module.inputs.x.dynamic.0.max=8"):
        with pytest.raises(ConfigError) as info:
            compose(["+module=mlp", override])
        assert str(info.value) == (
            "config key 'module.inputs.x.dynamic.0.max' = '8': a dotted key cannot reach an axis (Hydra reads 0 "
            "as text); merge it: '++module.inputs.x.dynamic={0: {max: 8}}'"
        )
    (x,) = spec_of("++module.inputs.x.dynamic={0: {max: 8}}").inputs
    assert (x.dynamic[0].min, x.dynamic[0].max, x.dynamic[0].name) == (1, 8, "batch")  # the rest as the YAML has it
    with pytest.raises(ConfigError, match=r"'verify.repet' = '2': not a config key"):  # the key that failed, named
        compose(["+module=mlp", "verify.repet=2", "module.inputs.x.dynamic.0.max=8"])


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("weights.path=x", "'weights.path' = 'x': weights holds a value (one of baked, external), not keys: set it "
         "with weights=..."),
        ("+verify.atol.rel=1", "'verify.atol.rel' = '1': verify.atol holds a value (float), not keys: set it with "
         "verify.atol=..."),
    ],
    ids=["choice", "number"],
)  # fmt: skip
def test_a_key_below_one_that_holds_a_value_says_what_the_value_is(override: str, said: str) -> None:
    """`weights.path=x` was answered 'Value {} (dict) is not a valid input for <enum 'WeightsMode'>'."""
    with pytest.raises(ConfigError) as info:
        compose(["+module=mlp", override])
    assert str(info.value) == f"config key {said}"


def test_the_api_refuses_an_unknown_key_in_a_plain_mapping() -> None:
    with pytest.raises(ConfigError, match=r"'verfy.enabled' = False: not a config key; did you mean verify.enabled\?"):
        as_build_config({"module": {"name": "m"}, "verfy": {"enabled": False}})


def test_an_output_location_that_cannot_be_written_names_its_key(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("x")
    before = sorted(tmp_path.rglob("*"))
    cases = {
        ("output_dir", "/proc/forbidden"): "creating a file in /proc fails (No such file or directory)",
        ("output_dir", str(tmp_path / "a-file" / "build")): "a-file is a file, not a directory",
        ("output_dir", str(tmp_path / "a-file")): "exists and is not a directory",
        ("output_root", "/proc/x"): "creating a file in /proc fails",
    }
    for (key, path), needle in cases.items():
        with pytest.raises(ConfigError) as info:
            spec_of(f"{key}={path}")
        assert (info.value.key, info.value.value, type(info.value)) == (key, path, ConfigError)  # only that key
        assert needle in str(info.value)
    assert sorted(tmp_path.rglob("*")) == before  # the probes leave nothing behind


def test_a_read_only_filesystem_is_refused_by_key(tmp_path: Path) -> None:
    with mounted(tmp_path / "ro", "ro") as mount:
        error = config_error(f"output_root={mount}", f"output_dir={mount / 'build'}")
        assert [p.key for p in error.problems] == ["output_root", "output_dir"]
        assert str(error).count("Read-only file system") == 2


def test_a_checkpoint_that_is_missing_or_an_empty_directory_is_refused(tmp_path: Path) -> None:
    missing = config_error(f"module.checkpoint={tmp_path / 'none.safetensors'}")
    assert missing.key == "module.checkpoint" and "no such file or directory" in str(missing)
    directory = config_error(f"module.checkpoint={tmp_path}")
    assert directory.key == "module.checkpoint" and "is a directory holding no checkpoint" in str(directory)


def test_a_config_dir_that_is_missing_or_a_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'config_dir' = .*: no such directory"):
        compose(["+module=mlp"], config_dir=tmp_path / "none")
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a directory of configs"):
        compose(["+module=mlp"], config_dir=tmp_path / "f")

    (tmp_path / "alias" / "module").mkdir(parents=True)
    (tmp_path / "alias" / "module" / "alias.yaml").write_text("a: &a [*a]\n")
    looped = config_error_of(lambda: compose(["+module=alias"], config_dir=tmp_path / "alias"))
    assert str(looped).endswith("alias.yaml holds a YAML alias that contains itself") and len(str(looped)) < 300
    (tmp_path / "laughs" / "module").mkdir(parents=True)
    levels = ["l0: &l0 [" + ", ".join(["x"] * 10) + "]"]
    levels += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]" for i in range(1, 9)]
    (tmp_path / "laughs" / "module" / "laughs.yaml").write_text("\n".join(levels) + "\n")  # 10^9 values
    bomb = config_error_of(lambda: compose(["+module=laughs"], config_dir=tmp_path / "laughs"))
    assert str(bomb).endswith("laughs.yaml expands its aliases to more than 1000000 values")
    (tmp_path / "deep" / "module").mkdir(parents=True)
    (tmp_path / "deep" / "module" / "deep.yaml").write_text("a: " + "[" * 5000 + "]" * 5000 + "\n")
    deep = config_error_of(lambda: compose(["+module=deep"], config_dir=tmp_path / "deep"))
    assert str(deep).endswith("deep.yaml nests deeper than a config can be read")
    (tmp_path / "bad" / "module").mkdir(parents=True)
    (tmp_path / "bad" / "module" / "bad.yaml").write_text("a: [" + "x, " * 5000)
    assert len(str(config_error_of(lambda: compose(["+module=bad"], config_dir=tmp_path / "bad")))) < 600


def config_error_of(call: Callable[[], object]) -> ConfigError:
    with pytest.raises(ConfigError) as raised:
        call()
    return raised.value


def shadowing_conf(conf: Path) -> Path:
    """A config dir whose files have shipped names: module/mlp.yaml and passes/llm.yaml."""
    (conf / "module").mkdir(parents=True)
    (conf / "passes").mkdir()
    (conf / "module" / "mlp.yaml").write_text(
        "name: mine\nmodel: {_target_: flashrt_build.examples.MLP, hidden: 7}\ninputs: {x: {shape: [2, 16]}}\n"
    )
    (conf / "passes" / "llm.yaml").write_text("name: llm\nfuse_projections: false\n")
    return conf


def test_a_config_dirs_file_of_a_shipped_name_wins(tmp_path: Path) -> None:
    """As the README says: today the shipped mlp and llm were composed, silently."""
    conf = shadowing_conf(tmp_path / "conf")
    cfg = compose(["+module=mlp", "passes=llm"], config_dir=conf)
    assert cfg.module.name == "mine" and cfg.module.model.hidden == 7
    assert cfg.passes.fuse_projections is False and cfg.passes.gemv is False
    assert compose(["+module=mlp"]).module.name == "mlp"  # without it, the shipped one


def test_the_command_line_composes_a_config_dirs_file_of_a_shipped_name(tmp_path: Path) -> None:
    from clitools import cli

    conf = shadowing_conf(tmp_path / "conf")
    shown = cli("--config-dir", str(conf), "+module=mlp", "passes=llm", "--cfg", "job")
    assert shown.returncode == 0, shown.stderr
    assert "name: mine" in shown.stdout and "hidden: 7" in shown.stdout and "fuse_projections: false" in shown.stdout
    (conf / "config.yaml").write_text("defaults: []\n")
    refused = cli("--config-dir", str(conf), "+module=mlp", "--cfg", "job")
    assert refused.returncode == 2 and "holds config.yaml, which would replace the tool's own config" in refused.stderr


def test_mistakes_point_the_right_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A misspelt constructor argument, a group's key without its group, a
    module config beside the command line but not given to it."""
    conf = tmp_path / "my_conf"
    (conf / "module").mkdir(parents=True)
    (conf / "module" / "mine.yaml").write_text(
        "name: mine\nmodel: {_target_: flashrt_build.examples.MLP, hidden: 4}\ninputs: {x: {shape: [2, 16]}}\n"
    )
    with pytest.raises(ConfigError, match=r"'module.model.hiden' = '5': not in the config; did you mean "
                                          r"module.model.hidden\?"):  # fmt: skip
        compose(["+module=mine", "module.model.hiden=5"], config_dir=conf)
    with pytest.raises(ConfigError, match=r"'pretrained' = 'llama': not a config key; did you mean module.pretrained"):
        compose(["+module=mlp", "pretrained=llama"])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"my_conf/module/mine.yaml is one: add --config-dir my_conf"):
        compose(["+module=mine"])


def test_the_config_dir_may_follow_the_overrides() -> None:
    from flashrt_build.config.command_line import flags_first

    given = ["-m", "+module=x", "--config-dir", "d", "seed=1,2", "--config-name=c"]
    assert flags_first(given) == ["--config-dir", "d", "--config-name=c", "-m", "+module=x", "seed=1,2"]


def test_a_long_variant_is_shortened_keeping_variants_apart() -> None:
    from flashrt_build.config.naming import variant_of

    many = {"module": {"model": {f"width_{i}": i for i in range(20)}}}
    other = {"module": {"model": {**many["module"]["model"], "width_19": 7}}}
    empty = {"module": {"model": {}}}
    first, second = variant_of(many, empty), variant_of(other, empty)
    assert first is not None and second is not None and first != second
    assert len(first) <= 96 and first.startswith("module.model.width_0_0-") and first == variant_of(many, empty)
    # and it builds a usable directory name: the lock file beside it fits in 255 bytes
    assert len(f".cpu-external-default-{first}.lock") < 255


def test_release_allows_exactly_the_shipped_configs_targets() -> None:
    import yaml

    from flashrt_build.config.targets import RELEASE_TARGETS, find_targets

    shipped = {
        target
        for path in (CONF_DIR / "module").glob("*.yaml")
        for _, target in find_targets(yaml.safe_load(path.read_text())["model"], "module.model")
    }
    assert set(RELEASE_TARGETS) == shipped
    assert not any("*" in pattern for pattern in RELEASE_TARGETS)  # named one by one, no wildcard


@pytest.mark.parametrize("where", ["top", "nested", "args"])
def test_allowed_targets_check_what_a_target_really_is(tmp_path: Path, where: str) -> None:
    """`transformers.*` used to admit `transformers.modeling_utils.torch.save`
    (Hydra follows attributes through modules), at any depth: a release build
    wrote an arbitrary file. Now the located object's real name is checked
    before anything is instantiated."""
    import flashrt_build

    payload = tmp_path / "written-by-the-config"
    save = f"{{_target_: transformers.modeling_utils.torch.save, _args_: [pwned, '{payload}']}}"
    model = {
        "top": save,
        "nested": f"{{_target_: transformers.GPT2LMHeadModel, config: {save}}}",
        "args": f"{{_target_: transformers.GPT2LMHeadModel, _args_: [{save}]}}",
    }[where]
    (tmp_path / "module").mkdir()
    (tmp_path / "module" / "evil.yaml").write_text(f"name: evil\nmodel: {model}\ninputs: {{x: {{shape: [2]}}}}\n")
    cfg = compose(
        ["+module=evil", "release=true", "allowed_targets=[transformers.*]", f"output_root={tmp_path / 'out'}"],
        config_dir=tmp_path,
    )
    with pytest.raises(ConfigError) as info:
        flashrt_build.build(cfg)
    keys = {"top": "module.model", "nested": "module.model.config", "args": "module.model._args_.0"}
    assert info.value.key == f"{keys[where]}._target_"
    assert "is torch.serialization.save, which allowed_targets does not admit" in str(info.value)
    assert not payload.exists() and not (tmp_path / "out").exists()


def test_a_pattern_naming_a_path_exactly_admits_it_as_written() -> None:
    from flashrt_build.config.targets import target_allowed

    real = "transformers.models.gpt2.modeling_gpt2.GPT2LMHeadModel"
    assert target_allowed("transformers.GPT2LMHeadModel", ["transformers.GPT2LMHeadModel"], real)
    assert target_allowed("transformers.GPT2LMHeadModel", ["transformers.*"], real)
    assert not target_allowed("transformers.modeling_utils.torch.save", ["transformers.*"], "torch.serialization.save")
    assert not target_allowed("evil.Run", ["transformers.*"])  # refused before anything is imported


def test_overrides_the_variant_never_names_need_no_second_compose() -> None:
    from flashrt_build.config.naming import names_nothing

    chosen = ["+module=mlp", "quant=int8_wo"]
    assert names_nothing([*chosen, "output_root=x", "verify.rtol=1e-3", "+module.pretrained=d"], chosen)
    assert not names_nothing([*chosen, "seed=1"], chosen)
    assert not names_nothing([*chosen, "verifyx=1"], chosen)  # a key that only starts like an unnamed one
    assert compose(["+module=mlp", "seed=1", "verify.rtol=1e-3"]).variant == "seed_1"
