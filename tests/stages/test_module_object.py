"""A build straight from a module object, as torch.export takes one: the
same verified package and manifest a config gives, the caller's object left
as it was, keyed by what the object is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.export import Dim

import flashrt_build
from flashrt_build.errors import ConfigError
from flashrt_build.stages.objects import GIVEN, graph_code, object_digest


class Scaled(torch.nn.Module):
    """Token ids and a float input, positionally: an embedding, a projection, a scale."""

    def __init__(self, vocab: int = 50) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, 16)
        self.proj = torch.nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.proj(self.embed(ids)) * scale


def examples(length: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(length)
    return torch.randint(0, 50, (2, length), generator=generator), torch.rand(2, length, 1, generator=generator)


SEQ = Dim("seq", min=2, max=32)


def digest(module: torch.nn.Module) -> str:
    return object_digest(module, graph_code(module, examples(), {"ids": {1: SEQ}, "scale": {1: SEQ}}))[0]


@pytest.fixture(scope="module")
def scaled() -> Scaled:
    torch.manual_seed(0)
    return Scaled()


def build_scaled(scaled: Scaled, root: Path) -> flashrt_build.BuildResult:
    return flashrt_build.build(
        scaled,
        example_inputs=examples(),
        dynamic_shapes={"ids": {1: SEQ}, "scale": {1: SEQ}},
        input_ranges={"ids": (0, 50)},
        weights="external",
        output_root=root,
    )


@pytest.fixture(scope="module")
def before(scaled: Scaled) -> dict[str, torch.Tensor]:
    """The object's tensors before any build of it."""
    return {name: tensor.clone() for name, tensor in scaled.state_dict().items()}


@pytest.fixture(scope="module")
def object_build(
    scaled: Scaled, before: dict[str, torch.Tensor], tmp_path_factory: pytest.TempPathFactory
) -> flashrt_build.BuildResult:
    return build_scaled(scaled, tmp_path_factory.mktemp("object"))


@pytest.mark.slow
def test_a_module_object_builds_a_verified_package_and_is_left_as_it_was(
    scaled: Scaled, before: dict[str, torch.Tensor], object_build: flashrt_build.BuildResult
) -> None:
    manifest = object_build.manifest
    assert object_build.status == "built" and manifest["verification"]["passed"] is True
    assert object_build.output_dir.name == "cpu-external-default" and object_build.output_dir.parent.name == "scaled"
    assert (object_build.output_dir / "weights.safetensors").is_file()
    record = manifest["module"]["object"]
    assert record["class"] == f"{__name__}.Scaled" and record["source_file"] == __file__
    assert record["sha256"] == digest(scaled)
    inputs = manifest["config"]["module"]["inputs"]
    assert inputs["ids"]["dtype"] == "int64" and dict(inputs["ids"]["dynamic"]) == {
        1: {"name": "seq", "min": 2, "max": 32}
    }
    assert (inputs["ids"]["low"], inputs["ids"]["high"]) == (0, 50) and inputs["scale"]["low"] is None

    model = flashrt_build.load(object_build.output_dir)
    for length in (2, 8, 31):  # the dynamic axis, as the examples declared it
        torch.testing.assert_close(model(*examples(length)), scaled(*examples(length)))
    with pytest.raises(ValueError, match=r"input 'ids' holds values from 0 to 50; the package accepts 0 to 49"):
        model(torch.tensor([[0, 50], [1, 2]]), torch.ones(2, 2, 1))  # past the embedding
    # the caller's object: not put in eval mode, not cast, not rewritten
    assert scaled.training and all(torch.equal(before[k], v) for k, v in scaled.state_dict().items())


@pytest.mark.slow
def test_an_unchanged_object_is_up_to_date_and_a_changed_one_is_not(
    scaled: Scaled, object_build: flashrt_build.BuildResult
) -> None:
    again = build_scaled(scaled, object_build.output_dir.parents[1])
    assert again.status == "up_to_date" and again.output_dir == object_build.output_dir
    changed = Scaled()
    changed.load_state_dict(scaled.state_dict())
    assert digest(changed) == digest(scaled)  # another object, the same contents
    with torch.no_grad():
        changed.proj.bias.add_(1)
    assert digest(changed) != digest(scaled)
    changed.proj.bias.data = scaled.proj.bias.clone()
    changed.extra = 2.0  # an attribute forward could read: a pickle keys it too
    assert digest(changed) != digest(scaled)


ACTIVATION = [torch.relu]


class Helped(Scaled):
    """A forward that calls code its pickle and its class's file do not hold."""

    def forward(self, ids: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return ACTIVATION[0](super().forward(ids, scale))


def test_what_the_forward_computes_keys_the_object_not_only_its_pickle_and_file() -> None:
    helped = Helped()
    before = digest(helped)
    ACTIVATION[0] = torch.tanh  # a helper edited (another module's function), a method patched in
    try:
        assert digest(helped) != before
    finally:
        ACTIVATION[0] = torch.relu
    assert digest(helped) == before
    first, why = object_digest(helped, None)  # a forward that does not export: built every time
    assert first.startswith("unkeyed-") and "did not export" in str(why)


def test_a_class_without_a_source_file_is_keyed_by_its_graph() -> None:
    import sys
    import types

    from flashrt_build.stages.preflight import source_file

    cell = sys.modules["notebook_cell"] = types.ModuleType("notebook_cell")  # a kernel's __main__: no file
    try:
        orphan = cell.Orphan = type("Orphan", (Scaled,), {"__module__": "notebook_cell"})
        assert source_file(orphan) is None
        assert not digest(orphan()).startswith("unkeyed-")
    finally:
        del sys.modules["notebook_cell"]


def test_an_object_that_does_not_pickle_is_built_every_time_and_says_why() -> None:
    module = torch.nn.Linear(2, 2)
    module.register_forward_hook(lambda *args: None)
    first, why = object_digest(module, "its graph")
    assert first.startswith("unkeyed-") and why is not None and "lambda" in why
    assert object_digest(module, "its graph")[0] != first


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"overrides": ["release=true"]}, "config key 'release' = True: a module object cannot be a release"),
        ({"dynamic_shapes": {"ids": {1: Dim("seq")}}}, "\"Dim('seq', min=0)\": expected torch.export.Dim(name, min="),
        ({"dynamic_shapes": {"idz": {1: SEQ}}}, "names no input; the inputs are ids, scale"),
        ({"dynamic_shapes": {"ids": {5: SEQ}}}, "expected an axis of ids, 0..1"),
        ({"input_ranges": {"ids": (0, 10)}}, "input_ranges['ids']' = (0, 10): the example holds"),
        ({"input_ranges": {"scale": (0, 10)}}, "scale is float32: a range is for an integer input"),
    ],
)
def test_what_a_build_from_an_object_refuses_before_any_work(options: dict, says: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as raised:
        given = {**options, "overrides": [*options.get("overrides", []), f"output_root={tmp_path}"]}
        flashrt_build.build(Scaled(), example_inputs=examples(), **given)
    assert says in str(raised.value)
    assert not list(tmp_path.iterdir())  # nothing written


def test_too_many_examples_and_options_without_an_object_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"Scaled.forward takes 2 positionally \(ids, scale\)"):
        flashrt_build.build(Scaled(), example_inputs=(*examples(), torch.ones(1)))
    with pytest.raises(TypeError, match=r"example_inputs are options of a build from a module object"):
        flashrt_build.build({"module": {}}, example_inputs=examples())


def test_an_object_that_cannot_be_copied_is_named_not_built_in_place(tmp_path: Path) -> None:
    import threading

    locked = Scaled()
    locked.lock = threading.Lock()  # a build rewrites its copy, never the caller's object
    with pytest.raises(ConfigError, match=r"argument 'model' = 'Scaled': cannot be copied \(TypeError: cannot pickle"):
        flashrt_build.build(locked, example_inputs=examples(), output_root=tmp_path)


def test_arguments_a_python_user_gets_wrong_are_named(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"overrides: expected a list of key=value texts.*got 'verify.rtol=1e-3'"):
        flashrt_build.build(Scaled(), example_inputs=examples(), overrides="verify.rtol=1e-3")
    with pytest.raises(ConfigError, match=r"argument 'overrides' = \['module.name=zzz'\]: the module is the object"):
        flashrt_build.build(Scaled(), example_inputs=examples(), overrides=["module.name=zzz"])
    with pytest.raises(TypeError, match=r"got the class Scaled: build\(Scaled\(...\), ...\)"):
        flashrt_build.build(Scaled, example_inputs=examples())
    with pytest.raises(TypeError, match=r"output_root: expected a non-empty path or text, got 5"):
        flashrt_build.build(Scaled(), example_inputs=examples(), output_root=5)
    with pytest.raises(TypeError, match=r"name: expected a non-empty path or text, got ''"):
        flashrt_build.build(Scaled(), example_inputs=examples(), name="")
    with pytest.raises(ConfigError, match=r"'overrides' = \['output_root=k3'\]: output_root is given as a keyword too"):
        flashrt_build.build(
            Scaled(), example_inputs=examples(), output_root=tmp_path / "k2", overrides=["output_root=k3"]
        )
    assert not list(tmp_path.iterdir())


def test_a_config_error_about_the_examples_names_the_argument_they_came_from() -> None:
    from flashrt_build.object_inputs import as_argument

    names = ["ids", "scale"]
    for key, argument in [
        ("module.inputs.ids.high", "input_ranges['ids']"),
        ("module.inputs.scale.dynamic.1.max", "dynamic_shapes['scale'][1]"),
        ("module.inputs.scale.shape", "example_inputs[1]"),
        ("module.inputs.ids", "example_inputs[0]"),
    ]:
        named = as_argument(ConfigError(key, 7, "expected less"), names)
        assert (named.kind, named.key, named.expected) == ("argument", argument, "expected less")
    other = ConfigError("verify.rtol", 1, "expected less")
    assert as_argument(other, names) is other
    occupied = ConfigError("output_dir", "L", f"holds the build of /m, another model than {GIVEN}: keep both with "
                           "module.name=NAME (or output_dir=DIR)")  # fmt: skip
    named = as_argument(occupied, names, "pkg.Net")
    assert (named.kind, named.key) == ("argument", "output_dir")
    assert named.expected.startswith(
        "holds the build of /m, another model than the pkg.Net object: keep both with name="
    )


def test_a_stage_error_about_an_example_names_the_argument_it_came_from() -> None:
    from flashrt_build.object_inputs import inputs_as_arguments

    said = inputs_as_arguments(
        "could not allocate the example input module.inputs.scale of shape [9]", ["ids", "scale"]
    )
    assert said == "could not allocate the example input example_inputs[1] (scale) of shape [9]"


@pytest.mark.slow
def test_another_class_of_the_same_name_does_not_replace_a_build(object_build: flashrt_build.BuildResult) -> None:
    namesake = type("Scaled", (Scaled,), {"__module__": "another_package.models"})  # its folder is scaled/ too
    with pytest.raises(ConfigError, match=rf"holds the build of {__name__}.Scaled, another class than another_pa"):
        build_scaled(namesake(), object_build.output_dir.parents[1])
    assert (
        json.loads((object_build.output_dir / "manifest.json").read_text())["build_key"]
        == object_build.manifest["build_key"]
    )
