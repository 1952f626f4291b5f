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
