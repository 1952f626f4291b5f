"""What of a model's directory is an input: its files, not what a build of
this tool left inside it (an output directory, its lock, a staging folder)."""

from __future__ import annotations

import json
from pathlib import Path

from flashrt_build.artifact import MANIFEST, SCHEMA, STAGING_PREFIX
from flashrt_build.cache.key import changed_ingredients
from flashrt_build.config.files import directory_files


def test_a_build_inside_a_model_directory_is_not_one_of_its_inputs(tmp_path: Path) -> None:
    model = tmp_path / "llama"
    (model / "sub").mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights")
    (model / "sub" / MANIFEST).write_text(json.dumps({"schema": SCHEMA}))  # output_dir=llama/sub
    (model / "sub" / "model.pt2").write_bytes(b"package")
    (model / ".sub.lock").write_text("")
    (model / f"{STAGING_PREFIX}sub-1").mkdir()
    (model / f"{STAGING_PREFIX}sub-1" / "model.pt2").write_bytes(b"half")
    (model / "notes").mkdir()  # a folder of the model's own, without a build's manifest, stays an input
    (model / "notes" / "README.md").write_text("mine")
    found = [p.relative_to(model).as_posix() for p in directory_files("module.pretrained", str(model), model)]
    assert found == ["config.json", "model.safetensors", "notes/README.md"]


def test_a_changed_file_of_a_subfolder_is_named_with_its_folder() -> None:
    old = {"model_files": {"module.model.path/config.json": "a", "module.model.path/sub/tokenizer.json": "b"}}
    new = {"model_files": {"module.model.path/config.json": "a", "module.model.path/sub/tokenizer.json": "c"}}
    assert changed_ingredients(old, new) == ["model_files (sub/tokenizer.json)"]
    served = ("module.files.0/generation_config.json", "module.pretrained/generation_config.json")
    before, after = ({"weights": {"files": dict.fromkeys(served, sha)}} for sha in "ab")
    assert changed_ingredients(before, after) == ["weights (generation_config.json)"]  # a file two keys read, once


def test_a_link_to_a_directory_outside_the_model_is_named_not_walked(tmp_path: Path) -> None:
    import pytest

    from flashrt_build.errors import ConfigError

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "x.safetensors").write_bytes(b"x")
    (model / "ext").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match=r"holds ext, a link to .*elsewhere, a directory outside it"):
        directory_files("module.pretrained", str(model), model)
    (model / "ext").unlink()
    (model / "shard.safetensors").symlink_to(tmp_path / "elsewhere" / "x.safetensors")  # a hub cache's file links
    found = directory_files("module.pretrained", str(model), model)
    assert [p.name for p in found] == ["config.json", "shard.safetensors"]


def test_a_build_leaves_no_lock_beside_its_output_and_no_folder_it_made_empty(tmp_path: Path) -> None:
    from flashrt_build.cache.publish import build_lock

    out = tmp_path / "models" / "llama" / "sub"
    with build_lock(out):
        assert (out.parent / ".sub.lock").is_file()
    assert not out.parent.exists()  # made for this build, left empty: gone
    out.parent.mkdir()
    (out.parent / "config.json").write_text("{}")
    with build_lock(out):
        pass
    assert [p.name for p in out.parent.iterdir()] == ["config.json"]  # the user's folder: only its own file
