"""A save_pretrained directory is read as strictly as `module.checkpoint`:
an index may not reach outside it, a link loop is named, a file is not a
directory, a tensor that does not fit exits 2 naming it, and none of the
directory's own code is asked about or run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from clitools import QUIET, cli
from llm_families import causal_lm_overrides, copied
from safetensors.torch import load_file, save_file

import flashrt_build
from flashrt_build.cache.plan import make_plan
from flashrt_build.config.compose import compose
from flashrt_build.errors import ConfigError

EVIL = """
import pathlib
pathlib.Path({marker!r}).write_text("ran")
from transformers import LlamaConfig, LlamaForCausalLM
class EvilConfig(LlamaConfig):
    model_type = "evil_lm"
class EvilLM(LlamaForCausalLM):
    config_class = EvilConfig
"""


UP_TO_THE_CACHE = "from 2 to module.max_cache_len (32)"


def with_code(directory: Path, marker: Path, model_type: str) -> Path:
    """`directory` with its own modeling code (which writes `marker` when run), mapped by auto_map."""
    (directory / "modeling_evil.py").write_text(EVIL.format(marker=str(marker)))
    config = json.loads((directory / "config.json").read_text())
    config["model_type"] = model_type
    config["auto_map"] = {"AutoConfig": "modeling_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.EvilLM"}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


# --- the directory, read as a checkpoint is ---------------------------------------


def test_an_index_that_names_a_shard_outside_the_directory_is_refused(llama_dir: Path, tmp_path: Path) -> None:
    """Today transformers would read it, and no build key would hold it."""
    model = copied(llama_dir, tmp_path / "model")
    index = model / "model.safetensors.index.json"
    content = json.loads(index.read_text())
    (tmp_path / "elsewhere").mkdir()
    first = next(iter(content["weight_map"]))
    shard = content["weight_map"][first]
    shutil.copy(model / shard, tmp_path / "elsewhere" / "x.safetensors")
    outside = "../elsewhere/x.safetensors"
    content["weight_map"] = {k: outside if v == shard else v for k, v in content["weight_map"].items()}
    index.write_text(json.dumps(content))
    with pytest.raises(ConfigError, match=r"module.pretrained.*weight_map names '\.\./elsewhere/x\.safetensors'"):
        make_plan(compose(causal_lm_overrides(model, tmp_path / "out")))


def test_a_shard_that_is_a_link_is_read_and_keyed_by_what_it_holds(llama_dir: Path, tmp_path: Path) -> None:
    """A hub cache's snapshot: every file a link into a blob store beside it."""
    blobs, model = tmp_path / "blobs", tmp_path / "snapshot"
    shutil.copytree(llama_dir, blobs)
    model.mkdir()
    for file in blobs.iterdir():
        (model / file.name).symlink_to(file)
    plan = make_plan(compose(causal_lm_overrides(model, tmp_path / "out")))
    shards = [f for f in plan.spec.input_files if f.name.endswith(".safetensors")]
    assert shards and all(f.path.is_symlink() for f in shards)
    assert {f.label for f in shards} <= set(plan.digests)


def test_a_directory_of_two_checkpoints_is_read_as_transformers_reads_it(llama_dir: Path, tmp_path: Path) -> None:
    """A lone model.safetensors beside an index: transformers loads the lone
    file, and so must load(weights=DIR) and check, or they compare the build
    with other weights; a config.json's transformers_weights wins over both."""
    from flashrt_build.runtime.formats import resolve_checkpoint

    model = copied(llama_dir, tmp_path / "model")
    tensors = {k: v * 0.5 for f in sorted(model.glob("model-*.safetensors")) for k, v in load_file(f).items()}
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    assert resolve_checkpoint("weights", str(model), model).files == (model / "model.safetensors",)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "transformers_weights": "model.safetensors.index.json"}))
    chosen = resolve_checkpoint("weights", str(model), model)
    assert chosen.weight_map and model / "model.safetensors" not in chosen.files
    (model / "config.json").write_text(json.dumps({**config, "transformers_weights": "../x.safetensors"}))
    with pytest.raises(ConfigError, match=r"transformers_weights names '\.\./x\.safetensors': not a file in it"):
        resolve_checkpoint("weights", str(model), model)


def test_a_link_loop_is_named_never_walked(llama_dir: Path, tmp_path: Path) -> None:
    model = copied(llama_dir, tmp_path / "model")
    (model / "again").symlink_to(".")
    with pytest.raises(ConfigError, match=r"module.pretrained.*holds again, a link to .*a directory it is in: a loop"):
        make_plan(compose(causal_lm_overrides(model, tmp_path / "out")))


def test_a_file_is_not_a_save_pretrained_directory(llama_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'module.pretrained' = .*config.json.*is a file; give the save_pretrained"):
        make_plan(compose(causal_lm_overrides(llama_dir / "config.json", tmp_path / "out")))
    with pytest.raises(ConfigError, match=r"'module.pretrained' = .*: no such directory"):
        make_plan(compose(causal_lm_overrides(tmp_path / "absent", tmp_path / "out")))


def test_an_llm_lands_in_its_directorys_folder_and_records_absolute_paths(
    llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Named after the model (every LLM landed in outputs/causal_lm/), and its
    paths recorded absolute, so `repro` rebuilds it from any directory."""
    from llm_families import save_tokenizer

    work = tmp_path / "work"
    model = copied(llama_dir, work / "my_qwen")
    save_tokenizer(model)
    monkeypatch.chdir(work)
    here = make_plan(compose(causal_lm_overrides("my_qwen", Path("out"))))
    spec = here.spec
    assert spec.output_dir == work / "out" / "my_qwen" / "cpu-baked-default-module.max_cache_len_32"
    module = spec.config["module"]
    assert module["pretrained"] == module["model"]["pretrained"] == str(model)
    assert module["files"] and all(Path(f).is_absolute() and Path(f).parent == model for f in module["files"])
    monkeypatch.chdir(tmp_path)  # the recorded config, from elsewhere: the same files, the same key
    elsewhere = make_plan(compose(causal_lm_overrides(module["pretrained"], work / "out")))
    assert elsewhere.keys == here.keys and elsewhere.spec.input_files == spec.input_files


@pytest.mark.parametrize(
    ("overrides", "key", "said"),
    [
        (["module.max_cache_len=0"], "'module.max_cache_len' = 0", "expected the positions the KV cache holds"),
        (
            ["module.max_cache_len=1"],
            "'module.max_cache_len' = 1",
            "expected the positions the KV cache holds, at least 2",
        ),
        (["module.max_prompt=1"], "'module.max_prompt' = 1", f"expected a prompt length {UP_TO_THE_CACHE}"),
        (["module.max_cache_len=1000"], "'module.max_cache_len' = 1000", "the model has 256 positions"),
        (["module.max_prompt=0"], "'module.max_prompt' = 0", f"expected a prompt length {UP_TO_THE_CACHE}"),
        (["module.max_prompt=100"], "'module.max_prompt' = 100", f"expected a prompt length {UP_TO_THE_CACHE}"),
        (["module.batch=0"], "'module.batch' = 0", "expected the sequences decoded at once, at least 1"),
    ],
)
def test_the_keys_a_user_sets_are_the_keys_named(
    llama_dir: Path, tmp_path: Path, overrides: list[str], key: str, said: str
) -> None:
    """Today: the derived keys (`module.methods.decode.inputs.position.high`), or after instantiating it."""
    with pytest.raises(ConfigError) as raised:
        make_plan(compose(causal_lm_overrides(llama_dir, tmp_path / "out", *overrides)))
    assert f"config key {key}: {said}" in str(raised.value) and "module.methods" not in str(raised.value)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["missing", "wrong shape"])
def test_a_tensor_that_does_not_fit_exits_2_naming_it(
    llama_dir: Path, tmp_path: Path, fault: str, capfd: pytest.CaptureFixture[str]
) -> None:
    """Named by the key the user set, in one line: no report table of transformers' on the terminal."""
    model = copied(llama_dir, tmp_path / "model")
    index = model / "model.safetensors.index.json"
    content = json.loads(index.read_text())
    name = "model.layers.0.self_attn.q_proj.weight"
    shard = model / content["weight_map"][name]
    tensors = load_file(shard)
    if fault == "missing":
        del tensors[name], content["weight_map"][name]
        index.write_text(json.dumps(content))
        said = f"1 missing: {name}"
    else:
        tensors[name] = tensors[name][:-1].clone()
        said = f"1 wrong shape: {name} [63, 64] (the model expects [64, 64])"
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(ConfigError) as raised:
        flashrt_build.build(compose(causal_lm_overrides(model, tmp_path / "out")))
    assert raised.value.key == "module.pretrained" and said in str(raised.value)
    assert "LOAD REPORT" not in capfd.readouterr().err
    result = cli(*causal_lm_overrides(model, tmp_path / "out"))
    assert result.returncode == 2 and said in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_the_shipped_pretrained_gpt2_names_a_wrongly_shaped_tensor(tmp_path: Path) -> None:
    """The regression: exit 1 and transformers' "look at the above report!"."""
    model = tmp_path / "gpt2"
    subprocess.run([*cli_python(), "-m", "flashrt_build.examples", str(model)], check=True, capture_output=True)
    content = json.loads((model / "model.safetensors.index.json").read_text())
    name = "transformer.wte.weight"
    shard = model / content["weight_map"][name]
    tensors = load_file(shard)
    tensors[name] = tensors[name][:-1].clone()
    save_file(tensors, str(shard), metadata={"format": "pt"})
    result = cli("+module=pretrained_gpt2", f"module.model.pretrained_model_name_or_path={model}",
                 f"output_root={tmp_path / 'out'}")  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "'module.model.pretrained_model_name_or_path'" in result.stderr
    assert f"1 wrong shape: {name} [999, 128] (the model expects [1000, 128])" in result.stderr
    assert "look at the above report" not in result.stderr + result.stdout


def cli_python() -> list[str]:
    import sys

    return [sys.executable]


# --- no code of the directory's --------------------------------------------------


@pytest.mark.slow
def test_a_release_refuses_a_directory_with_its_own_code_before_reading_it(llama_dir: Path, tmp_path: Path) -> None:
    """`yes | B ... release=true` ran the directory's code and published a release."""
    marker = tmp_path / "ran"
    model = with_code(copied(llama_dir, tmp_path / "model"), marker, "llama")
    result = subprocess.run(
        [*cli_python(), "-m", "flashrt_build", *causal_lm_overrides(model, tmp_path / "out", "release=true")],
        input="y\n" * 20, capture_output=True, text=True, timeout=600, env={**__import__("os").environ, **QUIET},
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "'module.pretrained'" in result.stderr and "auto_map" in result.stderr
    assert "modeling_evil.EvilLM" in result.stderr and "[y/N]" not in result.stdout
    assert not marker.exists() and [p.name for p in (tmp_path / "out").iterdir()] == [".runs"]  # Hydra's log alone


@pytest.mark.slow
def test_without_trust_remote_code_no_prompt_and_no_code_runs(llama_dir: Path, tmp_path: Path) -> None:
    """A model transformers does not ship is refused by name, with the key
    that would run it; one it ships (auto_map left in a config) is built with
    transformers' own class. Neither asks on the terminal."""
    marker = tmp_path / "ran"
    unknown = with_code(copied(llama_dir, tmp_path / "unknown"), marker, "evil_lm")
    result = subprocess.run(
        [*cli_python(), "-m", "flashrt_build", *causal_lm_overrides(unknown, tmp_path / "out")],
        input="y\n" * 20, capture_output=True, text=True, timeout=600, env={**__import__("os").environ, **QUIET},
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "'module.pretrained'" in result.stderr and "module.model.trust_remote_code=true" in result.stderr
    assert "[y/N]" not in result.stdout and not marker.exists()
    from flashrt_build.stages.module import instantiate_module

    known = with_code(copied(llama_dir, tmp_path / "known"), marker, "llama")
    module = instantiate_module(make_plan(compose(causal_lm_overrides(known, tmp_path / "out"))).spec)
    assert type(module._model).__module__.startswith("transformers.") and not marker.exists()


@pytest.mark.slow
def test_weights_that_unpickle_only_by_running_code_or_a_cache_too_large_are_config_errors(
    llama_dir: Path, tmp_path: Path
) -> None:
    """A pytorch_model.bin whose pickle calls os.system: torch's weights_only
    load refuses it (nothing runs), said as the directory's, exit 2 as for
    module.checkpoint; a batch whose KV cache cannot be allocated names module.batch."""
    import pickle

    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self) -> tuple:
            return (os.system, (f"touch {marker}",))

    model = tmp_path / "pickled"
    model.mkdir()
    shutil.copy(llama_dir / "config.json", model / "config.json")
    (model / "pytorch_model.bin").write_bytes(pickle.dumps({"model.embed_tokens.weight": Payload()}))
    from flashrt_build.stages.module import instantiate_module

    with pytest.raises(ConfigError, match=r"'module.pretrained' = .*unpickles only by running code"):
        instantiate_module(make_plan(compose(causal_lm_overrides(model, tmp_path / "out"))).spec)
    assert not marker.exists()
    with pytest.raises(ConfigError, match=r"'module.batch' = 100000000: a KV cache of 100000000 sequence"):
        instantiate_module(
            make_plan(compose(causal_lm_overrides(llama_dir, tmp_path / "out", "module.batch=100000000"))).spec
        )


@pytest.mark.slow
def test_another_models_config_with_the_same_tensors_is_refused_at_load_and_check(
    llama_lm_build: tuple[flashrt_build.BuildResult, Path], tmp_path: Path
) -> None:
    """The same tensors under another config.json (a norm's eps) are another
    computation: `load(weights=DIR)` and `check` name the key; where a copy
    differs only in where it came from (transformers_version), it fits."""
    from flashrt_build.errors import WeightsMismatch
    from flashrt_build.runtime.checkpoint import check_checkpoint

    result, model_dir = llama_lm_build
    assert result.manifest["module"]["model_config"] == json.loads((model_dir / "config.json").read_text())
    resaved = copied(model_dir, tmp_path / "resaved")
    config = json.loads((resaved / "config.json").read_text())
    (resaved / "config.json").write_text(json.dumps({**config, "transformers_version": "0.0.1"}))
    assert check_checkpoint(result.output_dir, resaved) == {}
    (resaved / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "attention_dropout"}))
    assert check_checkpoint(result.output_dir, resaved) == {}  # a key left out is its default: the built value
    assert flashrt_build.load(result.output_dir, weights=resaved) is not None

    other = copied(model_dir, tmp_path / "other")
    (other / "config.json").write_text(json.dumps({**config, "rms_norm_eps": config["rms_norm_eps"] * 10}))
    problems = check_checkpoint(result.output_dir, other)
    assert problems == {"another config.json": [f"rms_norm_eps: {config['rms_norm_eps'] * 10!r} (the package was built "
                                                f"with {config['rms_norm_eps']!r})"]}  # fmt: skip
    with pytest.raises(WeightsMismatch, match=r"another config.json: rms_norm_eps: .* \(the package was built with"):
        flashrt_build.load(result.output_dir, weights=other)
