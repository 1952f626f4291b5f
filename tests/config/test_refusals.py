"""Refusals before any work, each naming the key a user set: odd files where
configs, checkpoints or served files should be, names that would put builds
on top of each other, values of the wrong kind. Nothing is compiled."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from llm_families import causal_lm_overrides, copied
from safetensors.torch import load_file, save_file

from flashrt_build.cache.digests import DigestCache
from flashrt_build.cache.plan import make_plan
from flashrt_build.config.command_line import check_command_line
from flashrt_build.config.compose import compose
from flashrt_build.errors import ConfigError


def refused(overrides: list[str], config_dir: Path | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as raised:
        make_plan(compose(overrides, config_dir=config_dir))
    return raised.value


def test_two_jobs_of_a_sweep_that_would_share_a_folder_are_refused(llama_dir: Path, tmp_path: Path) -> None:
    """Two directories of one name: each job's folder is named after it, and
    the later build replaced the earlier one in silence."""
    a = copied(llama_dir, tmp_path / "a" / "llama")
    b = copied(llama_dir, tmp_path / "b" / "llama")
    with pytest.raises(ConfigError, match=r"'output_dir' = .*llama/cpu-baked-default.*: is also sweep job 1's.*"
                                          r"module.name=.*\(sweep job 2 of 2"):  # fmt: skip
        check_command_line(["-m", "+module=causal_lm", f"module.pretrained={a},{b}", f"output_root={tmp_path}"])
    check_command_line(["-m", "+module=causal_lm", f"module.pretrained={a}", f"output_root={tmp_path}", "seed=1,2"])


@pytest.mark.parametrize("key", ["passes.name", "target.name", "inductor.name", "quant.name"])
def test_a_label_that_names_a_part_of_the_folder_must_be_a_name(key: str, tmp_path: Path) -> None:
    problem = refused(["+module=mlp", f"{key}=../../x", f"output_root={tmp_path}"])
    assert problem.key == key and "names a part of the output folder" in str(problem)


def test_an_output_dir_in_the_store_is_refused(tmp_path: Path) -> None:
    problem = refused(["+module=mlp", f"output_root={tmp_path}", f"output_dir={tmp_path / '.store' / 'x'}"])
    assert problem.key == "output_dir" and "is in the build store" in str(problem)


def test_odd_values_and_files_in_a_pretrained_directory_are_named(llama_dir: Path, tmp_path: Path) -> None:
    model = copied(llama_dir, tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": True}))
    assert "whose vocab_size is True, not a size" in str(refused(causal_lm_overrides(model, tmp_path / "out")))
    (model / "config.json").write_text(json.dumps(config))
    (model / "generation_config.json").write_text('{"temperature": NaN}')
    problem = refused(causal_lm_overrides(model, tmp_path / "out"))
    assert problem.key.startswith("module.files.") and "NaN is not a JSON value" in str(problem)
    (model / "generation_config.json").unlink()
    os.mkfifo(model / "tokenizer.json")  # would block a read: refused, never opened
    problem = refused(causal_lm_overrides(model, tmp_path / "out"))
    assert problem.key == "module.pretrained" and "holds tokenizer.json, which is not a regular file" in str(problem)


def test_an_index_that_places_a_tensor_in_the_wrong_shard_is_named(llama_dir: Path, tmp_path: Path) -> None:
    model = copied(llama_dir, tmp_path / "model")
    index = model / "model.safetensors.index.json"
    content = json.loads(index.read_text())
    shards = sorted(set(content["weight_map"].values()))
    name = next(n for n, shard in content["weight_map"].items() if shard == shards[0])
    content["weight_map"][name] = shards[1]
    index.write_text(json.dumps(content))
    problem = refused(causal_lm_overrides(model, tmp_path / "out"))
    assert f"places {name} in {shards[1]}, which lacks it; {shards[0]} holds it" in str(problem)


def test_a_checkpoint_that_is_a_link_loop_is_named(tmp_path: Path) -> None:
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    problem = refused(["+module=mlp", f"module.checkpoint={tmp_path / 'a'}", f"output_root={tmp_path / 'out'}"])
    assert problem.key == "module.checkpoint" and "is a link loop" in str(problem)


def test_a_fifo_where_a_config_or_the_digests_should_be_blocks_nothing(tmp_path: Path) -> None:
    conf = tmp_path / "conf"
    (conf / "module").mkdir(parents=True)
    os.mkfifo(conf / "module" / "stuck.yaml")
    problem = refused(["+module=mlp"], config_dir=conf)
    assert problem.key == "config_dir" and "stuck.yaml is not a regular file" in str(problem)
    store = tmp_path / ".store"
    store.mkdir()
    os.mkfifo(store / "digests.json")
    assert DigestCache(store).known(conf) is None  # read nothing from the FIFO, and returned


def test_an_allow_list_of_other_than_patterns_is_said_as_such(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'allowed_targets' = \[123\]: expected a list of fnmatch patterns"):
        compose(["+module=mlp", "allowed_targets=[123]"])


def test_a_misspelt_command_is_named_with_the_closest() -> None:
    done = subprocess.run([sys.executable, "-m", "flashrt_build", "genrate", "out"], capture_output=True, text=True)
    assert done.returncode == 2 and "no command 'genrate'; did you mean generate?" in done.stderr


def test_repro_names_an_input_that_changed_since_the_release(tmp_path: Path) -> None:
    from flashrt_build.commands.repro import check_inputs
    from flashrt_build.runtime.hashing import file_sha256

    shard = tmp_path / "model.safetensors"
    save_file({"w": load_file(str(save_tiny(tmp_path)))["w"]}, str(shard))
    entry = {"key": "module.pretrained", "path": str(shard), "sha256": file_sha256(shard)}
    check_inputs({"build_inputs": [entry]})
    shard.write_bytes(shard.read_bytes()[:-1] + b"\1")
    with pytest.raises(ConfigError, match=r"'module.pretrained' = .*model.safetensors.*changed since the release"):
        check_inputs({"build_inputs": [entry]})


def save_tiny(where: Path) -> Path:
    import torch

    path = where / "tiny.safetensors"
    save_file({"w": torch.ones(2)}, str(path))
    return path


def test_a_config_file_cannot_choose_code_under_release(tmp_path: Path) -> None:
    """python_path (a package shadowing a shipped target) and toolchain.cxx (a
    script) from a config dir's file: only the command line sets them under
    an allow-list."""
    conf = tmp_path / "conf"
    (conf / "module").mkdir(parents=True)
    body = "# @package _global_\nmodule:\n  name: evil\n  model: {_target_: flashrt_build.examples.MLP}\n" \
           "  inputs: {x: {shape: [2, 16]}}\n"  # fmt: skip
    (conf / "module" / "path.yaml").write_text(body + f"python_path: [{tmp_path}]\n")
    (conf / "module" / "cxx.yaml").write_text(body + f"toolchain: {{cxx: {tmp_path / 'cxx.sh'}}}\n")
    for name, key in (("path", "python_path"), ("cxx", "toolchain.cxx")):
        with pytest.raises(ConfigError, match=rf"'{key}' = .*set by a config file under an allow-list"):
            compose([f"+module={name}", "release=true"], config_dir=conf)
        compose([f"+module={name}"], config_dir=conf)  # no allow-list: the user's own config
    compose(["+module=path", "release=true", f"python_path=[{tmp_path}]"], config_dir=conf)  # said on the command line


def flashrt(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flashrt_build", *args], capture_output=True, text=True, timeout=300, cwd=cwd
    )


@pytest.mark.parametrize("group", ["passes", "module", "quant"])
def test_a_config_group_set_to_null_is_named_with_its_choices(group: str) -> None:
    with pytest.raises(ConfigError, match=rf"config group '{group}' = None: .*its configs \(shipped: .*\), not null"):
        compose(["+module=mlp", f"{group}=null"])


def test_a_group_given_twice_gets_command_line_advice() -> None:
    with pytest.raises(ConfigError, match=r"'\+passes' = 'llm': passes already has a config: write passes=llm"):
        compose(["+module=mlp", "+passes=llm"])


def test_a_value_a_config_file_set_is_shown_as_the_file_gave_it(tmp_path: Path) -> None:
    (tmp_path / "passes").mkdir()
    (tmp_path / "passes" / "fast.yaml").write_text("fuse_everything: true\n")
    (tmp_path / "module").mkdir()
    (tmp_path / "module" / "m2.yaml").write_text(
        "# @package _global_\nweights: banana\nmodule:\n  name: m2\n  model: {_target_: flashrt_build.examples.MLP}\n"
    )
    with pytest.raises(
        ConfigError, match=r"'passes.fuse_everything' = True: not a config key.*\(in passes/fast.yaml\)"
    ):
        compose(["+module=mlp", "passes=fast"], config_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"'weights' = 'banana': Invalid value 'banana'.*\(in module/m2.yaml\)"):
        compose(["+module=m2"], config_dir=tmp_path)


def test_a_config_dir_cannot_replace_the_schema_and_a_replaced_group_file_is_named(tmp_path: Path) -> None:
    schema = tmp_path / "schema"
    schema.mkdir()
    (schema / "flashrt_build_schema.yaml").write_text("weights: banana\n")
    with pytest.raises(ConfigError, match=r"holds flashrt_build_schema.yaml, which would replace the tool's typed"):
        compose(["+module=mlp"], config_dir=schema)
    (tmp_path / "tg" / "target").mkdir(parents=True)
    (tmp_path / "tg" / "target" / "cpu.yaml").write_text("device: cuda\n")
    done = flashrt("--config-dir", str(tmp_path / "tg"), "+module=mlp", f"output_root={tmp_path / 'out'}")
    if "no CUDA device" in done.stderr:  # on a GPU host target.device=cuda is fine: the file is then not an error
        assert done.returncode == 2
        assert f"(target=cpu is {tmp_path / 'tg' / 'target' / 'cpu.yaml'}, which replaces the shipped" in done.stderr


def test_a_link_to_the_same_model_directory_is_the_same_model(tmp_path: Path) -> None:
    from flashrt_build.artifact import MANIFEST, SCHEMA
    from flashrt_build.config.paths import check_same_model

    (tmp_path / "zoo" / "llama").mkdir(parents=True)
    (tmp_path / "links").mkdir()
    (tmp_path / "links" / "llama").symlink_to(tmp_path / "zoo" / "llama")
    out = tmp_path / "out"
    out.mkdir()
    (out / MANIFEST).write_text(
        json.dumps({"schema": SCHEMA, "config": {"module": {"pretrained": str(tmp_path / "zoo" / "llama")}}})
    )
    check_same_model(out, {"module": {"pretrained": str(tmp_path / "links" / "llama"), "model": {}}})
    (tmp_path / "other" / "llama").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"holds the build of .*zoo/llama, another model than .*other/llama"):
        check_same_model(out, {"module": {"pretrained": str(tmp_path / "other" / "llama"), "model": {}}})


def test_repro_names_the_pretrained_key_the_user_set(tmp_path: Path) -> None:
    from flashrt_build.commands.repro import check_inputs

    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text("{}")
    entry = {"key": "module.model.pretrained", "path": str(tmp_path / "llama" / "config.json"), "sha256": "0" * 64}
    manifest = {"config": {"module": {"pretrained": str(tmp_path / "llama")}}, "build_inputs": [entry]}
    with pytest.raises(ConfigError, match=r"config key 'module.pretrained' = .*config.json': changed since"):
        check_inputs(manifest)


def test_a_target_of_the_interpreters_own_code_is_named_not_a_missing_file(tmp_path: Path) -> None:
    model = ["~module.model.in_features", "~module.model.hidden", "~module.model.out_features"]
    for target in ("builtins.dict", "os.getcwd"):  # a built-in module, a frozen one: no source file
        done = flashrt("+module=mlp", *model, f"module.model._target_={target}", f"output_root={tmp_path}")
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert f"config key 'module.model._target_' = '{target}': expected an nn.Module" in done.stderr


def test_a_command_word_out_of_place_is_said_to_go_first(tmp_path: Path) -> None:
    done = flashrt("-m", "generate", "out")
    assert done.returncode == 2 and "'generate' is a command: it goes first (flashrt-build generate ...)" in done.stderr
    done = flashrt("doctor", "--config-dir", "cfgs", "+module=m2")
    assert done.returncode == 2 and "'--config-dir' is not an option of doctor" in done.stderr


def test_inductor_options_cannot_choose_the_compiler_nor_under_release_name_code(tmp_path: Path) -> None:
    (tmp_path / "inductor").mkdir()
    (tmp_path / "inductor" / "fast.yaml").write_text("name: fast\noptions: {cpp.cxx: /tmp/evil.sh}\n")
    (tmp_path / "inductor" / "cutlass.yaml").write_text(f"name: cutlass\noptions: {{cuda.cutlass_dir: {tmp_path}}}\n")
    with pytest.raises(ConfigError, match=r"'inductor.options.cpp.cxx' = '/tmp/evil.sh': the C\+\+ compiler is chosen"):
        make_plan(compose(["+module=mlp", "inductor=fast"], config_dir=tmp_path))
    with pytest.raises(ConfigError, match=r"'inductor.methods.forward.cpp.cxx' = 'g\+\+': the C\+\+ compiler"):
        make_plan(compose(["+module=mlp", "+inductor.methods.forward={cpp.cxx: g++}"]))
    with pytest.raises(ConfigError, match=r"'inductor.options.cuda.cutlass_dir' = .*set by a config file under an"):
        compose(["+module=mlp", "inductor=cutlass", "release=true"], config_dir=tmp_path)
    compose(["+module=mlp", "inductor=cutlass"], config_dir=tmp_path)  # no allow-list: the user's own config
    # a text option reaches the compiler's command line: a flag in it runs code ("-wrapper X" runs X)
    (tmp_path / "inductor" / "flags.yaml").write_text(
        "name: flags\noptions: {aot_inductor.compile_wrapper_opt_level: 'O1 -wrapper /tmp/evil.sh'}\n"
    )
    with pytest.raises(ConfigError, match=r"'inductor.options.aot_inductor.compile_wrapper_opt_level' = 'O1 -wrapper"):
        compose(["+module=mlp", "inductor=flags", "release=true"], config_dir=tmp_path)


def test_an_inductor_option_may_name_code_unless_it_is_a_number_a_switch_or_a_known_word() -> None:
    from flashrt_build.config.compiler import code_options

    words = {"max_autotune": True, "cpp.simdlen": 8, "aot_inductor.compile_wrapper_opt_level": "O3",
             "max_autotune_gemm_backends": "ATEN,TRITON", "cpp.enable_floating_point_contract_flag": "off"}  # fmt: skip
    assert code_options(words) == []
    code = {"aot_inductor.compile_wrapper_opt_level": "B/tmp/evil", "cuda.cutlass_dir": "/src",
            "cpp.enable_floating_point_contract_flag": "off -B.", "aot_inductor.custom_op_libs": ["evil"],
            "trace.debug_dir": "/tmp/x", "aot_inductor.output_path": "/etc/x"}  # fmt: skip
    assert code_options({**words, **code}) == sorted(code)


def test_a_config_file_that_is_no_mapping_and_a_fifo_for_config_json_are_named(tmp_path: Path) -> None:
    from flashrt_build.runtime.formats import check_pretrained_dir, resolve_checkpoint

    (tmp_path / "conf" / "module").mkdir(parents=True)
    (tmp_path / "conf" / "module" / "p.yaml").write_text("root:x:0:0:root:/root:/bin/bash\n")
    with pytest.raises(ConfigError, match=r"p.yaml holds a str, not a mapping of config keys"):
        compose(["+module=p"], config_dir=tmp_path / "conf")
    model = tmp_path / "model"
    model.mkdir()
    os.mkfifo(model / "config.json")
    with pytest.raises(ConfigError, match=r"holds config.json, which is a FIFO, not a regular file"):
        check_pretrained_dir("module.pretrained", str(model), model)
    (model / "config.json").unlink()
    (model / "config.json").write_text("{}")
    os.mkfifo(model / "model.safetensors.index.json")
    with pytest.raises(ConfigError, match=r"holds model.safetensors.index.json, which is a FIFO, not a regular file"):
        check_pretrained_dir("module.pretrained", str(model), model)  # before transformers blocks on opening it
    from flashrt_build.runtime.checkpoint import config_differences

    os.unlink(model / "config.json")
    os.mkfifo(model / "config.json")  # a checkpoint served at load: check and --weights compare it, never block
    assert config_differences({"module": {"model_config": {}}}, model) == ["config.json is not a regular file"]
    with pytest.raises(ConfigError, match=r"holds model.safetensors.index.json, which is a FIFO, not a regular file"):
        resolve_checkpoint("module.pretrained", str(model), model)


@pytest.mark.parametrize("key", ["module.name", "variant"])
def test_a_name_past_what_a_folder_holds_is_refused_by_its_key(key: str, tmp_path: Path) -> None:
    from flashrt_build.config.spec import resolve_spec

    with pytest.raises(ConfigError, match=rf"'{key}' = 'aaaa.*': expected at most 96 letters"):
        resolve_spec(compose(["+module=mlp", f"{key}={'a' * 300}", f"output_root={tmp_path}"]))
    assert not list(tmp_path.iterdir())


def test_a_code_option_counts_as_the_command_lines_only_where_it_sets_that_very_key(tmp_path: Path) -> None:
    (tmp_path / "inductor").mkdir()
    evil = "O1 -wrapper /tmp/evil.sh"
    (tmp_path / "inductor" / "fast.yaml").write_text(
        f"name: fast\noptions: {{}}\nmethods: {{forward: {{aot_inductor.compile_wrapper_opt_level: '{evil}'}}}}\n"
    )
    for also in ("+inductor.options.aot_inductor.compile_wrapper_opt_level=O2",  # another key of the same name
                 f"output_root={tmp_path}/out_aot_inductor.compile_wrapper_opt_level",
                 "inductor.methods.forward={}", "inductor.methods={}"):  # a mapping merges  # fmt: skip
        with pytest.raises(ConfigError, match=r"'inductor.methods.forward.aot_inductor.compile_wrapper_opt_level'"):
            compose(["+module=mlp", "inductor=fast", "release=true", also], config_dir=tmp_path)


def test_repro_sets_aside_every_spelling_of_an_option_that_may_name_code() -> None:
    from flashrt_build.commands.repro import _set_aside_code_options

    evil = "O1 -wrapper /tmp/evil.sh"
    options = {"aot_inductor.compile_wrapper_opt_level": evil, "aot_inductor": {"compile_wrapper_opt_level": evil},
               "max_autotune": True}  # fmt: skip
    said = _set_aside_code_options(options)
    assert options == {"aot_inductor": {}, "max_autotune": True} and len(said) == 1 and evil in said[0]


def test_a_temp_dir_nothing_can_be_made_in_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from flashrt_build.runtime.tempdir import check_temp_dir

    monkeypatch.setenv("TMPDIR", "/proc")  # a directory root may "write" by access(), where no folder can be made
    with pytest.raises(ConfigError, match=r"environment variable 'TMPDIR' = '/proc': is not writable"):
        check_temp_dir()


def test_names_say_their_rule_and_a_trailing_newline_is_no_name(tmp_path: Path) -> None:
    from flashrt_build.config.inputs import NAME
    from flashrt_build.config.spec import resolve_spec

    assert NAME.match("net") and not NAME.match("net\n")
    with pytest.raises(ConfigError, match=r"'module.name' = '.hidden': expected .* the first a letter or digit"):
        resolve_spec(compose(["+module=mlp", "module.name=.hidden", f"output_root={tmp_path}"]))


def test_inductors_trace_writes_files_so_repro_sets_it_aside() -> None:
    from flashrt_build.config.compiler import code_options

    assert code_options({"trace.enabled": True, "trace.debug_dir": None, "max_autotune": True}) == ["trace.enabled"]
    assert code_options({"trace.enabled": False}) == []


def test_examples_names_a_directory_it_cannot_create(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    done = subprocess.run(
        [sys.executable, "-m", "flashrt_build.examples", "--llm", str(tmp_path / "notes.txt" / "sub")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and "cannot be created" in done.stderr and "Traceback" not in done.stderr
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_repro_names_a_forged_manifests_methods_that_are_no_mapping() -> None:
    from flashrt_build.commands.repro import untrusted

    config = {"inductor": {"options": {}, "methods": [{"aot_inductor.compile_wrapper_opt_level": "O1 -wrapper x"}]}}
    with pytest.raises(ConfigError, match=r"'inductor.methods' = .*expected a mapping of names to values"):
        untrusted(config)


def test_an_llm_key_on_a_module_that_never_reads_it_is_refused(tmp_path: Path) -> None:
    from flashrt_build.config.spec import resolve_spec

    with pytest.raises(
        ConfigError, match=r"'module.max_cache_len' = 7: is a \+module=causal_lm key; this module's config nev"
    ):
        resolve_spec(compose(["+module=mlp", "module.max_cache_len=7", f"output_root={tmp_path}"]))
    (tmp_path / "module").mkdir()  # a user's module that reads module.batch through its own interpolation
    (tmp_path / "module" / "batched.yaml").write_text(
        "name: batched\nbatch: 3\nmodel: {_target_: flashrt_build.examples.MLP}\n"
        "inputs: {x: {shape: ['${module.batch}', 16]}}\n"
    )
    spec = resolve_spec(compose(["+module=batched", f"output_root={tmp_path}"], config_dir=tmp_path))
    assert spec.inputs[0].shape == (3, 16)
    (tmp_path / "module" / "relative.yaml").write_text(  # read through a relative interpolation
        "name: relative\nbatch: 3\nmodel: {_target_: flashrt_build.examples.MLP}\n"
        "inputs: {x: {shape: ['${....batch}', 16]}}\n"
    )
    spec = resolve_spec(compose(["+module=relative", f"output_root={tmp_path}"], config_dir=tmp_path))
    assert spec.inputs[0].shape == (3, 16)
    with pytest.raises(ConfigError, match=r"'module.batch' = 2: is a \+module=causal_lm key"):  # a name is no read
        resolve_spec(compose(["+module=mlp", "module.name=module.batch", "module.batch=2", f"output_root={tmp_path}"]))


def test_nothing_is_written_inside_another_builds_artifact(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An artifact that holds entries its build did not write refuses to serve."""
    from flashrt_build.artifact import MANIFEST, SCHEMA
    from flashrt_build.config.spec import resolve_spec
    from flashrt_build.examples import main as examples

    artifact = tmp_path / "served"
    artifact.mkdir()
    (artifact / MANIFEST).write_text(json.dumps({"schema": SCHEMA}))
    with pytest.raises(ConfigError, match=rf"'output_dir' = '{artifact}/sub': is inside {artifact}, another build's"):
        resolve_spec(compose(["+module=mlp", f"output_dir={artifact}/sub", f"output_root={tmp_path}"]))
    assert examples(["--llm", str(artifact / "ex" / "deeper")]) == 2
    assert f"is inside {artifact}, a build's artifact" in capsys.readouterr().err
    assert sorted(p.name for p in artifact.iterdir()) == [MANIFEST]


def test_a_primary_config_of_the_users_is_checked_as_the_shipped_one_is(tmp_path: Path) -> None:
    from flashrt_build.config.command_line import check_command_line

    (tmp_path / "mine.yaml").write_text("defaults: [config, _self_]\nseed: 3\n")
    (tmp_path / "preload.yaml").write_text("defaults: [config, _self_]\nhydra: {job: {env_set: {LD_PRELOAD: /x.so}}}\n")
    (tmp_path / "widen.yaml").write_text("defaults: [config, _self_]\nallowed_targets: ['*']\n")
    given = ["--config-dir", str(tmp_path), "+module=mlp", "release=true"]
    assert check_command_line([*given, "--config-name", "mine"]) is None  # composed, checked, then Hydra's to run
    with pytest.raises(ConfigError, match=r"'hydra.job.env_set.LD_PRELOAD' = '/x.so': set by a config file"):
        check_command_line([*given, "--config-name", "preload"])
    with pytest.raises(ConfigError, match=r"'allowed_targets' = \['\*'\]: set by a config file"):
        check_command_line([*given, "--config-name", "widen"])
    with pytest.raises(ConfigError, match=r"argument '--config-path' = .*: replaces the tool's own config directory"):
        check_command_line(["--config-path", str(tmp_path), "+module=mlp"])


def test_an_output_root_inside_an_artifact_is_refused_and_gets_no_logs(tmp_path: Path) -> None:
    from flashrt_build.artifact import MANIFEST, SCHEMA

    artifact = tmp_path / "served"
    artifact.mkdir()
    (artifact / MANIFEST).write_text(json.dumps({"schema": SCHEMA}))
    for root in (artifact, artifact / "deeper"):
        done = subprocess.run([sys.executable, "-m", "flashrt_build", "+module=mlp", f"output_root={root}"],
                              capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
        assert done.returncode == 2 and f"config key 'output_root' = '{root}': is " in done.stderr, done.stderr
    assert sorted(p.name for p in artifact.iterdir()) == [MANIFEST]  # Hydra's .runs went elsewhere
    for flags, key in (([], "hydra.run.dir"), (["-m", "seed=1,2"], "hydra.sweep.dir")):  # Hydra's own folders
        done = subprocess.run([sys.executable, "-m", "flashrt_build", *flags, "+module=mlp", f"{key}={artifact}/logs",
                               f"output_root={tmp_path}/out"], capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 2 and f"config key '{key}' = '{artifact}/logs': is inside" in done.stderr
    assert sorted(p.name for p in artifact.iterdir()) == [MANIFEST]


def test_a_key_inside_a_swept_group_is_named_not_a_traceback() -> None:
    from flashrt_build.config.command_line import check_command_line
    from flashrt_build.config.schema import register_schema

    register_schema()  # as the command line does first
    with pytest.raises(ConfigError, match=r"'module.max_prompt' = 4: is inside the config group 'module', which this"):
        check_command_line(["-m", "+module=mlp,tiny_lm", "module.max_prompt=4"])
    assert check_command_line(["-m", "+module=mlp,tiny_lm", "seed=1,2"]) is None  # a sweep: Hydra runs it


def test_a_jobs_environment_or_directory_from_a_file_leaves_the_up_to_date_answer_to_hydra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The answer before Hydra runs sees the config: a file's hydra.job.env_set (a checkpoint path
    from the environment, $CXX) or chdir would change what Hydra's run builds."""
    import flashrt_build.cache.reuse as reuse
    from flashrt_build.cli import up_to_date_before_hydra
    from flashrt_build.config.command_line import check_command_line
    from flashrt_build.config.schema import register_schema

    register_schema()
    monkeypatch.setattr(reuse, "decide", lambda plan, say_why=True: reuse.Reuse("up_to_date", {}))
    (tmp_path / "module").mkdir()
    module = "module: {name: m, model: {_target_: flashrt_build.examples.MLP}, inputs: {x: {shape: [4, 16]}}}\n"
    for name, job in (("plain", "{}"), ("env", "{env_set: {CKPT: b.safetensors}}"), ("chdir", "{chdir: true}")):
        (tmp_path / "module" / f"{name}.yaml").write_text(f"# @package _global_\nhydra: {{job: {job}}}\n{module}")
    answers, handlers, level = {}, logging.root.handlers[:], logging.root.level
    try:  # the answer configures logging as Hydra's run would: put pytest's back after
        for name in ("plain", "env", "chdir"):
            argv = ["--config-dir", str(tmp_path), f"+module={name}", f"output_root={tmp_path}/out"]
            composed = check_command_line(argv)
            assert composed is not None
            answers[name] = up_to_date_before_hydra(composed, argv)
    finally:
        logging.root.handlers[:], logging.root.level = handlers, level
    assert answers == {"plain": True, "env": False, "chdir": False}


def test_a_key_every_build_has_cannot_be_removed(tmp_path: Path) -> None:
    from flashrt_build.config.spec import resolve_spec

    with pytest.raises(ConfigError, match=r"'seed' = None: is a key every build has: set it \(seed=\.\.\.\), not remo"):
        resolve_spec(compose(["+module=mlp", "~seed", f"output_root={tmp_path}"]))  # a KeyError, exit 1, before


def test_composing_names_a_missing_primary_and_hydras_run_settings(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"argument '--config-name' = 'mine': .* holds no mine.yaml; a primary"):
        compose(["+module=mlp"], config_dir=tmp_path, config_name="mine")  # it blamed 'command line', said nothing
    with pytest.raises(ConfigError, match=r"argument 'overrides' = \['hydra.job.env_set.X=1'\]: hydra.\* set Hydra's"):
        compose(["+module=mlp", "hydra.job.env_set.X=1"])  # a KeyError: 'hydra', before
    with pytest.raises(ConfigError, match=r"'overrides' = \['--config-name=mine'\]: flags are the command line's"):
        compose(["+module=mlp", "--config-name=mine"])  # "quote a value", before
