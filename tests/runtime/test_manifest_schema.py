"""The manifest's schema is written once (flashrt_build/runtime/manifest.schema.json):
a valid JSON Schema, agreeing with the loader's own validator, the typed
structures the code uses, and the fields the C++ reader reads."""

from __future__ import annotations

import copy
import json
import re
import typing
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

import flashrt_build
from flashrt_build.runtime.manifest import FileRecord, InputEntry, Manifest, MethodEntry
from flashrt_build.runtime.schema import SCHEMA_FILE, manifest_schema, schema_problems

REPO = Path(__file__).resolve().parents[2]


def test_the_shipped_schema_is_a_json_schema_and_ships_with_the_package() -> None:
    Draft202012Validator.check_schema(manifest_schema())
    assert SCHEMA_FILE.parent == Path(flashrt_build.__file__).parent / "runtime"
    pyproject = (REPO / "pyproject.toml").read_text()
    assert "runtime/manifest.schema.json" in pyproject  # package data: installed with the runtime


def test_the_typed_structures_name_the_schemas_fields() -> None:
    schema = manifest_schema()
    defs = schema["$defs"]
    assert set(typing.get_type_hints(Manifest)) == set(schema["properties"])
    assert set(typing.get_type_hints(FileRecord)) == set(defs["file_record"]["properties"])
    assert set(typing.get_type_hints(InputEntry)) == set(defs["inputs"]["items"]["properties"])
    assert set(typing.get_type_hints(MethodEntry)) == set(
        schema["properties"]["methods"]["additionalProperties"]["properties"]
    )


def _all_property_names(node: object) -> set[str]:
    names: set[str] = set()
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "properties" and isinstance(value, dict):
                names |= set(value)
            names |= _all_property_names(value)
    elif isinstance(node, list):
        for item in node:
            names |= _all_property_names(item)
    return names


def test_every_field_the_cpp_reader_reads_is_in_the_schema() -> None:
    source = (REPO / "cpp" / "src" / "manifest.cpp").read_text()
    read = set(re.findall(r'\["([a-z_0-9]+)"\]', source)) | set(re.findall(r'has\("([a-z_0-9]+)"\)', source))
    read |= set(re.findall(r'contains\("([a-z_0-9]+)"\)', source)) | set(re.findall(r'value\("([a-z_0-9]+)"', source))
    read |= set(re.findall(r'value_or_null\([^,]+, "([a-z_0-9]+)"\)', source))
    assert len(read) > 20  # the extraction found the reader's keys
    assert read - _all_property_names(manifest_schema()) == set()


@pytest.mark.slow
def test_the_loaders_validator_agrees_with_jsonschema(
    mlp_build: flashrt_build.BuildResult, lm_build: flashrt_build.BuildResult
) -> None:
    validator = Draft202012Validator(manifest_schema())
    for manifest in (mlp_build.manifest, lm_build.manifest):
        good = json.loads(json.dumps(manifest))
        assert schema_problems(good) == [] and list(validator.iter_errors(good)) == []
        edits = [
            lambda m: m["weights"].update(mode="sideways"),
            lambda m: m.pop("inputs"),
            lambda m: m["inputs"][0].update(shape=[0, 4]),
            lambda m: m["package"].update(file="../x"),
            lambda m: m["package"].update(sha256="abc"),
            lambda m: m["target"].update(device="tpu"),
            lambda m: m["weights"]["tensors"][0].update(kind="weird"),
            lambda m: m.update(release="yes"),
        ]
        for edit in edits:
            broken = copy.deepcopy(good)
            edit(broken)
            assert schema_problems(broken) and list(validator.iter_errors(broken))


def test_the_toolchain_record_is_stated_once() -> None:
    """One definition (config/toolchain.py) of what `toolchain` records: the
    description, the schema and the docs' table agree with it."""
    from flashrt_build.config.toolchain import KEY_FIELDS, TOOLCHAIN_FIELDS, describe_toolchain

    assert list(describe_toolchain(None, None)) == list(TOOLCHAIN_FIELDS)
    assert set(KEY_FIELDS) <= set(TOOLCHAIN_FIELDS)
    assert set(manifest_schema()["properties"]["toolchain"]["properties"]) == set(TOOLCHAIN_FIELDS)
    docs = (REPO / "docs" / "building.md").read_text()
    for field, meaning in TOOLCHAIN_FIELDS.items():
        assert f"| `{field}` | {meaning} |" in docs, field


def test_a_folder_that_is_no_build_points_at_the_builds_near_it(tmp_path: Path) -> None:
    """`load('outputs/mlp')` (the module's folder) or `load('.../model.pt2')` said only 'holds no complete build'."""
    from flashrt_build.errors import ArtifactError
    from flashrt_build.runtime.manifest import read_manifest

    for variant in ("cpu-external-default", "cpu-baked-default"):
        (tmp_path / "mlp" / variant).mkdir(parents=True)
        (tmp_path / "mlp" / variant / "manifest.json").write_text("{}")
    (tmp_path / "mlp" / "notes").mkdir()
    build = tmp_path / "mlp" / "cpu-baked-default"
    (build / "model.pt2").write_bytes(b"")
    cases = {
        tmp_path / "mlp": "; the builds in it: cpu-baked-default, cpu-external-default",
        build / "model.pt2": f"; model.pt2 is a file of the build at {build}",
        tmp_path: "",  # the builds are two levels down: not searched for
    }
    for path, said in cases.items():
        with pytest.raises(ArtifactError) as info:
            read_manifest(path)
        assert str(info.value) == f"{path / 'manifest.json'} does not exist: {path} holds no complete build{said}"
