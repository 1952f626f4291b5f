"""Trained models from where their weights live: `save_pretrained`
directories (sharded, bf16, tied weights written once), single files, a
Lightning checkpoint renamed, a `from_pretrained` target. Every file a build
reads is an input of its key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import flashrt_build
from flashrt_build.cache.digests import DigestCache
from flashrt_build.config.compose import compose
from flashrt_build.config.spec import resolve_spec
from flashrt_build.errors import ConfigError
from flashrt_build.examples import save_gpt2_tiny
from flashrt_build.runtime.checkpoint import check_checkpoint
from flashrt_build.stages.inputs import make_inputs
from flashrt_build.stages.module import instantiate_module

TEN_SECONDS_AGO = time.time() - 10


def settle(folder: Path) -> None:
    """Date every file in `folder` ten seconds back, as files written before
    a build are: a digest taken within a second of a write is not trusted."""
    for path in folder.rglob("*"):
        os.utime(path, (TEN_SECONDS_AGO, TEN_SECONDS_AGO))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Real `save_pretrained` directories and a Lightning checkpoint, each
    with weights that differ from the configs' seeded random init."""
    from transformers import BertConfig, BertModel

    root = tmp_path_factory.mktemp("trained")
    save_gpt2_tiny(str(root / "gpt2"))  # three bf16 shards, lm_head tied to wte and left out
    torch.manual_seed(99)
    bert = BertModel(
        BertConfig(
            num_hidden_layers=2,
            hidden_size=128,
            num_attention_heads=4,
            intermediate_size=256,
            vocab_size=1000,
            max_position_embeddings=128,
        )
    )
    bert.save_pretrained(root / "bert")  # one model.safetensors
    from flashrt_build.examples import MLP

    torch.manual_seed(4321)
    state = {f"model.{name}": tensor for name, tensor in MLP().state_dict().items()}
    torch.save({"state_dict": state, "epoch": 7, "global_step": 700}, root / "lightning.ckpt")
    settle(root)
    return {"gpt2": root / "gpt2", "bert": root / "bert", "lightning": root / "lightning.ckpt", "root": root}


def eager(*overrides: str) -> torch.nn.Module:
    return instantiate_module(resolve_spec(compose(list(overrides))))


def test_a_sharded_directory_resolves_to_its_shards_in_index_order(trained: dict[str, Path]) -> None:
    spec = resolve_spec(compose(["+module=gpt2_tiny", f"module.checkpoint={trained['gpt2']}"]))
    assert [f.name for f in spec.input_files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert spec.checkpoint is not None and spec.checkpoint.format == "safetensors"
    assert len(spec.checkpoint.weight_map) == 28  # lm_head.weight is not in it: tied to wte


@pytest.mark.slow
def test_a_sharded_bf16_directory_with_tied_weights_builds_with_its_own_weights(
    trained: dict[str, Path], gpt2_external_build: flashrt_build.BuildResult
) -> None:
    """module.checkpoint=DIR: three shards, bf16, lm_head.weight absent (its
    twin wte is there). The graph is gpt2_tiny's, so its compiled package is reused."""
    root = gpt2_external_build.output_dir.parent
    overrides = ["+module=gpt2_tiny", "weights=external", f"module.checkpoint={trained['gpt2']}"]
    result = flashrt_build.build(compose([*overrides, f"output_dir={root / 'trained'}", f"output_root={root}"]))
    assert result.manifest["package"]["reused"] is True  # a checkpoint swap: no compile
    assert result.manifest["verification"]["passed"] is True
    files = result.manifest["module"]["checkpoint"]["files"]
    assert [f["file"] for f in files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert [i["file"] for i in result.manifest["build_inputs"]] == [f["file"] for f in files]

    from transformers import GPT2LMHeadModel

    reference = GPT2LMHeadModel.from_pretrained(trained["gpt2"]).float().eval()
    fresh = eager("+module=gpt2_tiny")
    assert not torch.equal(reference.transformer.wte.weight, fresh.transformer.wte.weight)  # trained, not the init
    ids = make_inputs(resolve_spec(compose(overrides)), seed=3, sizes={"seq": 40}).kwargs["input_ids"]
    with torch.no_grad():
        want = reference(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(flashrt_build.load(result.output_dir)(input_ids=ids).logits, want)
    # The same directory binds to the plain gpt2_tiny package without a build, and `check` says it fits.
    assert check_checkpoint(gpt2_external_build.output_dir, trained["gpt2"]) == {}
    swapped = flashrt_build.load(gpt2_external_build.output_dir, weights=trained["gpt2"])
    torch.testing.assert_close(swapped(input_ids=ids).logits, want)


@pytest.mark.slow
def test_a_from_pretrained_target_builds_and_every_file_of_its_directory_is_an_input(
    trained: dict[str, Path], tmp_path: Path
) -> None:
    """`_target_: transformers.AutoModelForCausalLM.from_pretrained` (a class
    method, which Hydra locates) used to be refused as unimportable."""
    overrides = [
        "+module=pretrained_gpt2",
        f"module.model.pretrained_model_name_or_path={trained['gpt2']}",
        "weights=external",
        f"output_dir={tmp_path / 'out'}",
        f"output_root={tmp_path}",
    ]
    result = flashrt_build.build(compose(overrides))
    m = result.manifest
    assert m["module"]["callable"] == "transformers.models.auto.auto_factory._BaseAutoModelClass.from_pretrained"
    assert m["module"]["distribution"]["name"] == "transformers"
    kinds = {i["file"]: i["kind"] for i in m["build_inputs"]}
    assert kinds["config.json"] == "model" and kinds["model-00002-of-00003.safetensors"] == "weights"
    assert set(kinds) == {p.name for p in trained["gpt2"].iterdir()}

    from transformers import GPT2LMHeadModel

    reference = GPT2LMHeadModel.from_pretrained(trained["gpt2"]).float().eval()
    ids = torch.randint(0, 1000, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(flashrt_build.load(result.output_dir)(input_ids=ids).logits, want)


@pytest.mark.slow
def test_a_changed_shard_rebuilds_naming_it_and_a_touched_one_stays_a_no_op(
    trained: dict[str, Path], gpt2_external_build: flashrt_build.BuildResult, tmp_path: Path
) -> None:
    import shutil

    checkpoint = tmp_path / "gpt2"
    shutil.copytree(trained["gpt2"], checkpoint)
    settle(checkpoint)
    root = gpt2_external_build.output_dir.parent
    cfg = compose(
        [
            "+module=gpt2_tiny",
            "weights=external",
            f"module.checkpoint={checkpoint}",
            f"output_dir={tmp_path / 'out'}",
            f"output_root={root}",
        ]
    )
    assert flashrt_build.build(cfg).status in ("built", "from_store")
    shard = checkpoint / "model-00002-of-00003.safetensors"

    # Touched, not changed: its stat differs, so it is read again, and the build stays up to date.
    os.utime(shard, (TEN_SECONDS_AGO + 1, TEN_SECONDS_AGO + 1))
    digests = DigestCache(root / ".store")
    digests.sha256_all(sorted(checkpoint.glob("*.safetensors")))
    assert digests.hashed == [shard.resolve()]  # the others were remembered by their stat
    digests.save()
    assert flashrt_build.build(cfg).status == "up_to_date"

    # Changed: one tensor of the second shard gets other values.
    tensors = load_file(str(shard))
    name = next(iter(tensors))
    tensors[name] = tensors[name] + 1
    save_file(tensors, str(shard), metadata={"format": "pt"})
    result = subprocess.run(
        [sys.executable, "-m", "flashrt_build", "+module=gpt2_tiny", "weights=external",
         f"module.checkpoint={checkpoint}", f"output_dir={tmp_path / 'out'}", f"output_root={root}"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "changed: weights (model-00002-of-00003.safetensors)" in result.stderr
    assert "reusing the package of graph" in result.stderr  # the weights changed, the graph did not


@pytest.mark.slow
def test_an_encoder_saved_as_one_file_builds_from_its_directory_or_the_file(
    trained: dict[str, Path], tmp_path: Path
) -> None:
    from transformers import BertModel

    out = tmp_path / "out"
    result = flashrt_build.build(
        compose(
            [
                "+module=bert_tiny",
                f"module.checkpoint={trained['bert']}",
                f"output_dir={out}",
                f"output_root={tmp_path}",
            ]
        )
    )
    assert [f["file"] for f in result.manifest["module"]["checkpoint"]["files"]] == ["model.safetensors"]
    reference = BertModel.from_pretrained(trained["bert"]).eval()
    ids = torch.randint(0, 1000, (2, 20), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 20, dtype=torch.int64)
    with torch.no_grad():
        want = reference(input_ids=ids, attention_mask=mask)
    got = flashrt_build.load(out)(input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, rtol=1e-4, atol=1e-4)
    assert not torch.equal(
        reference.embeddings.word_embeddings.weight, eager("+module=bert_tiny").embeddings.word_embeddings.weight
    )
    # The file itself names the same weights: the same build key.
    by_file = resolve_spec(compose(["+module=bert_tiny", f"module.checkpoint={trained['bert'] / 'model.safetensors'}"]))
    assert [f.path for f in by_file.input_files] == [trained["bert"] / "model.safetensors"]


@pytest.mark.slow
def test_a_lightning_checkpoint_with_a_prefix_is_renamed_into_the_module(
    trained: dict[str, Path], mlp_external_build: flashrt_build.BuildResult
) -> None:
    root = mlp_external_build.output_dir.parent
    rename = "module.checkpoint_rename=[{pattern: '^model\\.', replace: ''}]"
    overrides = ["+module=mlp", "weights=external", f"module.checkpoint={trained['lightning']}", rename]
    with pytest.raises(ConfigError, match=r"7 unexpected: model.fc1.bias, .*module.checkpoint_rename maps"):
        flashrt_build.build(compose([*overrides[:3], f"output_dir={root / 'lightning0'}", f"output_root={root}"]))
    result = flashrt_build.build(compose([*overrides, f"output_dir={root / 'lightning'}", f"output_root={root}"]))
    assert result.manifest["module"]["checkpoint"]["rename"] == [{"pattern": "^model\\.", "replace": ""}]
    assert result.manifest["module"]["checkpoint"]["format"] == "torch"
    reference = eager(*overrides)
    state = torch.load(trained["lightning"], weights_only=True)["state_dict"]
    torch.testing.assert_close(reference.fc1.weight, state["model.fc1.weight"])
    assert not torch.equal(reference.fc1.weight, eager("+module=mlp").fc1.weight)
    x = torch.randn(5, 16)
    with torch.no_grad():
        torch.testing.assert_close(flashrt_build.load(result.output_dir)(x), reference(x))


# Bad input: a clear error naming the key, exit 2, nothing written --------------------------------------


def broken_copy(source: Path, tmp_path: Path) -> Path:
    import shutil

    target = tmp_path / source.name
    shutil.copytree(source, target)
    return target


def refused(tmp_path: Path, *overrides: str) -> str:
    out = tmp_path / "out"
    with pytest.raises(ConfigError) as info:
        flashrt_build.build(compose([*overrides, f"output_dir={out / 'x'}", f"output_root={out}"]))
    assert info.value.key.startswith("module.checkpoint") and info.value.exit_code == 2
    assert not out.exists() or not [p for p in out.rglob("*") if p.is_file() and p.suffix != ".lock"]
    return str(info.value)


def test_a_shard_the_index_names_but_is_missing(trained: dict[str, Path], tmp_path: Path) -> None:
    checkpoint = broken_copy(trained["gpt2"], tmp_path)
    (checkpoint / "model-00002-of-00003.safetensors").unlink()
    said = refused(tmp_path, "+module=gpt2_tiny", f"module.checkpoint={checkpoint}")
    assert "lacks the shard model-00002-of-00003.safetensors (model.safetensors.index.json maps tensors to it)" in said


def test_a_truncated_shard(trained: dict[str, Path], tmp_path: Path) -> None:
    checkpoint = broken_copy(trained["gpt2"], tmp_path)
    shard = checkpoint / "model-00003-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])
    said = refused(tmp_path, "+module=gpt2_tiny", f"module.checkpoint={checkpoint}")
    assert "holds model-00003-of-00003.safetensors, which is a truncated safetensors file" in said


def test_an_index_pointing_outside_its_directory(trained: dict[str, Path], tmp_path: Path) -> None:
    checkpoint = broken_copy(trained["gpt2"], tmp_path)
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "../elsewhere.safetensors"
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
    said = refused(tmp_path, "+module=gpt2_tiny", f"module.checkpoint={checkpoint}")
    assert "whose weight_map names '../elsewhere.safetensors': a shard must be a file in that directory" in said


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda t: t.reshape(-1)[:-1], "shape [127999], the module's transformer.wte.weight is [1000, 128]"),
        (lambda t: t.to(torch.int32), "dtype int32, the module's transformer.wte.weight is float32"),
    ],
    ids=["shape", "dtype"],
)
def test_a_shard_holding_a_tensor_of_the_wrong_shape_or_dtype(
    trained: dict[str, Path], tmp_path: Path, change, needle: str
) -> None:
    checkpoint = broken_copy(trained["gpt2"], tmp_path)
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    shard = checkpoint / index["weight_map"]["transformer.wte.weight"]
    tensors = load_file(str(shard))
    tensors["transformer.wte.weight"] = change(tensors["transformer.wte.weight"]).contiguous()
    save_file(tensors, str(shard))
    said = refused(tmp_path, "+module=gpt2_tiny", f"module.checkpoint={checkpoint}")
    assert f"1 wrong: transformer.wte.weight in {shard.name}: {needle}" in said


def test_a_bin_checkpoint_that_needs_code_to_unpickle(tmp_path: Path) -> None:
    (tmp_path / "bins").mkdir()
    torch.save(torch.nn.Linear(16, 64), tmp_path / "bins" / "pytorch_model.bin")  # the module, not its state_dict
    said = refused(tmp_path, "+module=mlp", f"module.checkpoint={tmp_path / 'bins'}")
    assert "holds objects that need code to unpickle, which is never run" in said


def test_a_directory_without_a_checkpoint_and_missing_names_are_counted(
    trained: dict[str, Path], tmp_path: Path
) -> None:
    (tmp_path / "empty").mkdir()
    said = refused(tmp_path, "+module=mlp", f"module.checkpoint={tmp_path / 'empty'}")
    assert "holding no checkpoint: expected one of model.safetensors, model.safetensors.index.json" in said
    said = refused(tmp_path, "+module=mlp", f"module.checkpoint={trained['gpt2']}")
    assert (
        "does not fit the module: 7 missing: fc1.bias, fc1.weight, fc2.bias, fc2.weight, norm.bias and 2 more" in said
    )
    assert "28 unexpected:" in said


def test_tied_weights_given_twice_must_agree(trained: dict[str, Path], tmp_path: Path) -> None:
    checkpoint = broken_copy(trained["gpt2"], tmp_path)
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    shard = checkpoint / index["weight_map"]["transformer.wte.weight"]
    tensors = load_file(str(shard))
    tensors["lm_head.weight"] = torch.zeros_like(tensors["transformer.wte.weight"])
    save_file(tensors, str(shard))
    index["weight_map"]["lm_head.weight"] = shard.name
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
    said = refused(tmp_path, "+module=gpt2_tiny", f"module.checkpoint={checkpoint}")
    assert "which the module ties together" in said


def test_the_cli_refuses_a_bad_checkpoint_directory_with_exit_2(trained: dict[str, Path], tmp_path: Path) -> None:
    checkpoint = broken_copy(trained["gpt2"], tmp_path)
    (checkpoint / "model-00001-of-00003.safetensors").unlink()
    result = subprocess.run(
        [sys.executable, "-m", "flashrt_build", "+module=gpt2_tiny", f"module.checkpoint={checkpoint}",
         f"output_root={tmp_path / 'out'}"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "lacks the shard model-00001-of-00003.safetensors" in result.stderr and "instantiate" not in result.stderr
