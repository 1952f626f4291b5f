"""Real builds: each package is compiled once per session (conftest fixtures)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import flashrt_build
from flashrt_build.artifact import SCHEMA
from flashrt_build.cache.publish import STAGING_PREFIX
from flashrt_build.config.compose import compose
from flashrt_build.config.spec import resolve_spec
from flashrt_build.pipeline import STAGES
from flashrt_build.runtime.hashing import file_sha256
from flashrt_build.stages.inputs import make_inputs
from flashrt_build.stages.module import instantiate_module
from flashrt_build.stages.weights import tensor_sha256

pytestmark = pytest.mark.slow


def eager(*overrides: str) -> torch.nn.Module:
    return instantiate_module(resolve_spec(compose(list(overrides))))


def test_build_result_points_at_a_complete_artifact(mlp_build: flashrt_build.BuildResult) -> None:
    files = sorted(p.name for p in mlp_build.output_dir.iterdir())
    assert files == ["manifest.json", "model.pt2"]
    assert mlp_build.status in ("built", "up_to_date")  # another xdist worker may have built it first
    on_disk = json.loads((mlp_build.output_dir / "manifest.json").read_text())
    assert on_disk["build_key"] == mlp_build.manifest["build_key"]
    # nothing of this build left behind next to its output dir (staging and the
    # build lock are removed); other tests share this output root (and its store)
    name = mlp_build.output_dir.name
    siblings = {p.name for p in mlp_build.output_dir.parent.iterdir()}
    assert {".store", name} <= siblings
    assert not [s for s in siblings if s.startswith((f"{STAGING_PREFIX}{name}.", f".{name}.lock"))]


@pytest.mark.parametrize("batch", [1, 3, 17, 64])
def test_loaded_mlp_matches_eager_across_the_dynamic_batch(mlp_build: flashrt_build.BuildResult, batch: int) -> None:
    model = flashrt_build.load(mlp_build.output_dir)
    reference = eager("+module=mlp")
    x = torch.randn(batch, 16, generator=torch.Generator().manual_seed(batch))
    with torch.no_grad():
        torch.testing.assert_close(model(x=x), reference(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model(x), reference(x), rtol=1e-5, atol=1e-5)


def test_loaded_module_is_an_nn_module(mlp_build: flashrt_build.BuildResult) -> None:
    model = flashrt_build.load(mlp_build.output_dir)
    assert isinstance(model, torch.nn.Module) and model.manifest["name"] == "mlp"


def test_manifest_fqns_equal_package_constants_and_module_state(mlp_build: flashrt_build.BuildResult) -> None:
    tensors = mlp_build.manifest["weights"]["tensors"]
    fqns = [t["fqn"] for t in tensors]
    package = flashrt_build.load(mlp_build.output_dir)
    assert sorted(fqns) == sorted(package.constant_fqns())
    module = eager("+module=mlp")
    state = dict(module.state_dict())
    named = {t.get("source", t["fqn"]): t for t in tensors}
    assert set(state) <= set(named)
    assert set(named) - set(state) == {"lifted_tensor_0"}  # the literal in MLP.forward
    for name, value in state.items():
        entry = named[name]
        assert entry["shape"] == list(value.shape) and entry["dtype"] == "float32"
        assert entry["kind"] == ("buffer" if name == "output_scale" else "parameter")
        assert entry["sha256"] == tensor_sha256(value)
    assert named["lifted_tensor_0"]["kind"] == "constant" and named["lifted_tensor_0"]["shape"] == [8]


def test_manifest_has_every_contract_field(mlp_build: flashrt_build.BuildResult) -> None:
    m = mlp_build.manifest
    assert m["schema"] == SCHEMA and m["name"] == "mlp"
    assert m["module"]["target"] == "flashrt_build.examples.MLP" and len(m["module"]["source_sha256"]) == 64
    assert m["package"] == {
        "file": "model.pt2",
        "sha256": file_sha256(mlp_build.package),
        "bytes": mlp_build.package.stat().st_size,
        "chunk_bytes": 32 << 20,
        "chunk_sha256": [file_sha256(mlp_build.package)],  # a 2 MB package is one chunk
        "reused": False,
    }
    assert m["weights"]["mode"] == "baked" and m["weights"]["file"] is None and m["weights"]["sha256"] is None
    assert m["inputs"] == [
        {
            "name": "x",
            "shape": [4, 16],
            "dtype": "float32",
            "dynamic": {"0": {"name": "batch", "min": 1, "max": 64}},
            "positional": False,
            "low": None,
            "high": None,
        }
    ]
    assert m["outputs"] == [{"shape": ["batch", 8], "dtype": "float32"}]
    assert m["target"] == {"device": "cpu", "dtype": "float32", "tf32": None}
    assert m["inductor"]["options"]["always_keep_tensor_constants"] is True
    assert m["release"] is False
    assert m["config"]["module"]["name"] == "mlp" and len(m["config_sha256"]) == 64
    assert len(m["build_key"]) == 64 and len(m["graph_key"]) == 64 and m["build_key"] != m["graph_key"]
    tc = m["toolchain"]
    assert tc["torch"] == torch.__version__ and tc["cxx"]["path"] and tc["cxx"]["version"] != "unknown"
    assert {"python", "cuda", "gpu", "cpu_isa", "platform"} <= set(tc)
    v = m["verification"]
    assert v["passed"] is True and [p["sizes"] for p in v["probes"]][:4] == [
        {},
        {"batch": 1},
        {"batch": 33},
        {"batch": 64},
    ]
    assert all(o["max_abs_err"] <= o["atol"] or o["rel_err"] <= o["rtol"] for o in v["outputs"])
    # (the manifest stage's own time is the built result's, not in the file it writes: the fixture may be up to date)
    assert {"instantiate", "export", "compile", "package", "verify"} <= set(m["timings"])
    timed = [name.split()[0] for name in m["timings"]]  # "compile forward" is the compile stage's
    assert timed == [stage for stage in STAGES if stage in timed]  # in the pipeline's order


def test_load_refuses_a_package_altered_after_the_build(mlp_build: flashrt_build.BuildResult, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(mlp_build.output_dir, copy)
    data = bytearray((copy / "model.pt2").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (copy / "model.pt2").write_bytes(bytes(data))
    with pytest.raises(flashrt_build.ArtifactError, match=r"model.pt2 \(the package\) was altered after its build"):
        flashrt_build.load(copy)


def test_load_refuses_a_dir_without_manifest(tmp_path: Path) -> None:
    with pytest.raises(flashrt_build.ArtifactError, match="no complete build"):
        flashrt_build.load(tmp_path)


def test_checkpoint_is_really_used(
    mlp_build: flashrt_build.BuildResult, mlp_checkpoint_build: flashrt_build.BuildResult, mlp_checkpoint: Path
) -> None:
    x = torch.randn(5, 16)
    with_ckpt = flashrt_build.load(mlp_checkpoint_build.output_dir)(x=x)
    without = flashrt_build.load(mlp_build.output_dir)(x=x)
    assert not torch.allclose(with_ckpt, without)
    reference = eager("+module=mlp", f"module.checkpoint={mlp_checkpoint}")
    with torch.no_grad():
        torch.testing.assert_close(with_ckpt, reference(x))
    m = mlp_checkpoint_build.manifest
    assert m["module"]["checkpoint"]["sha256"] == file_sha256(mlp_checkpoint)
    assert m["build_key"] != mlp_build.manifest["build_key"]


def test_gpt2_tiny_matches_eager_with_a_model_output(gpt2_build: flashrt_build.BuildResult) -> None:
    model = flashrt_build.load(gpt2_build.output_dir)
    reference = eager("+module=gpt2_tiny")
    spec = resolve_spec(compose(["+module=gpt2_tiny"]))
    for seq in (2, 9, 128):
        example = make_inputs(spec, seed=seq, sizes={"seq": seq})
        with torch.no_grad():
            out, ref = model(input_ids=example.kwargs["input_ids"]), reference(**example.kwargs)
        assert type(out).__name__ == "CausalLMOutputWithCrossAttentions"
        torch.testing.assert_close(out.logits, ref.logits, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="use_cache=True differs"):
        model(input_ids=example.kwargs["input_ids"], use_cache=True)


def test_gpt2_tied_weights_are_listed_once_with_their_alias(gpt2_build: flashrt_build.BuildResult) -> None:
    tensors = gpt2_build.manifest["weights"]["tensors"]
    names = {t["fqn"] for t in tensors} | {a for t in tensors for a in t.get("aliases", [])}
    assert set(eager("+module=gpt2_tiny").state_dict()) <= names
    assert sorted(t["fqn"] for t in tensors) == sorted(flashrt_build.load(gpt2_build.output_dir).constant_fqns())
    assert gpt2_build.manifest["outputs"] == [{"shape": [2, "seq", 1000], "dtype": "float32"}]


def test_bert_tiny_matches_eager(bert_build: flashrt_build.BuildResult) -> None:
    model = flashrt_build.load(bert_build.output_dir)
    reference = eager("+module=bert_tiny")
    spec = resolve_spec(compose(["+module=bert_tiny"]))
    for seq in (2, 33, 128):
        example = make_inputs(spec, seed=seq, sizes={"seq": seq})
        with torch.no_grad():
            out, ref = model(**example.kwargs), reference(**example.kwargs)
        torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out.pooler_output, ref.pooler_output, rtol=1e-4, atol=1e-4)
    kinds = {t["fqn"]: t["kind"] for t in bert_build.manifest["weights"]["tensors"]}
    assert kinds["embeddings.position_ids"] == "buffer"  # non-persistent buffers are bound too
    assert len(bert_build.manifest["verification"]["outputs"]) == 2


def test_loaded_module_refuses_inputs_it_was_not_built_for(gpt2_build: flashrt_build.BuildResult) -> None:
    model = flashrt_build.load(gpt2_build.output_dir)
    batch = r"size 1 on axis 0; the package was built for 2 there \(a static axis\); if the model takes other sizes"
    with pytest.raises(
        ValueError, match=batch + r" there, build with '\+\+module.inputs.input_ids.dynamic=\{0: \{min: 1, max: 2\}\}'$"
    ) as refused:
        model(input_ids=torch.zeros(1, 8, dtype=torch.int64))
    override = str(refused.value).rpartition("build with ")[2].strip("'")  # as suggested, it composes:
    (ids,) = resolve_spec(compose(["+module=gpt2_tiny", override])).inputs
    assert {axis: (d.min, d.max) for axis, d in ids.dynamic.items()} == {0: (1, 2), 1: (2, 128)}
    with pytest.raises(ValueError, match=r"size 129 on axis 1 \('seq'\); the package accepts 2 to 128"):
        model(input_ids=torch.zeros(2, 129, dtype=torch.int64))
    with pytest.raises(TypeError, match="dtype int32; the package takes int64"):
        model(input_ids=torch.zeros(2, 8, dtype=torch.int32))
    with pytest.raises(TypeError, match="missing inputs: input_ids"):
        model()
    with pytest.raises(TypeError, match="'labels' is not an input of the package"):
        model(input_ids=torch.zeros(2, 8, dtype=torch.int64), labels=torch.zeros(2, 8, dtype=torch.int64))


def test_shared_dims_must_agree_at_run_time(bert_build: flashrt_build.BuildResult) -> None:
    model = flashrt_build.load(bert_build.output_dir)
    ids = torch.zeros(2, 8, dtype=torch.int64)
    with pytest.raises(ValueError, match="share dim 'seq' but have sizes 8 and 9"):
        model(input_ids=ids, attention_mask=torch.ones(2, 9, dtype=torch.int64))


@pytest.fixture(scope="module")
def flags_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[flashrt_build.BuildResult, Path]:
    """tests/modules.FlagsAndConstants, external weights: a flag fixed by
    `module.kwargs` on a dynamic batch, a buffer in a transposed layout, and
    `(y, None, 3)` returned."""
    tmp = tmp_path_factory.mktemp("flags")
    (tmp / "conf" / "module").mkdir(parents=True)
    (tmp / "conf" / "module" / "flags.yaml").write_text(
        "name: flags\nmodel: {_target_: modules.FlagsAndConstants}\n"
        "inputs: {x: {shape: [3, 4], dynamic: {0: {name: batch, min: 1, max: 16}}}}\nkwargs: {negate: true}\n"
    )
    cfg = compose(
        ["+module=flags", "weights=external", f"output_dir={tmp / 'out'}", f"output_root={tmp}"],
        config_dir=tmp / "conf",
    )
    return flashrt_build.build(cfg), tmp / "conf"


def test_constant_outputs_a_fixed_flag_and_a_transposed_weight_survive_the_package(
    flags_build: tuple[flashrt_build.BuildResult, Path],
) -> None:
    """The build used to crash writing the manifest (`Tensor is not JSON
    serializable`); the loaded package returned tensor(3) for eager's 3."""
    result, conf = flags_build
    assert result.manifest["verification"]["passed"] is True
    assert result.manifest["outputs"][1:] == [
        {"shape": None, "dtype": "NoneType", "value": None},
        {"shape": None, "dtype": "int", "value": 3},
    ]
    mix = next(t for t in result.manifest["weights"]["tensors"] if t["fqn"] == "mix")
    assert mix["stride"] == [1, 4]  # the sidecar holds it row-major; the load lays it out again
    reference = instantiate_module(resolve_spec(compose(["+module=flags"], config_dir=conf)))
    model = flashrt_build.load(result.output_dir)
    x = torch.randn(7, 4)
    y, none, three = model(x)
    assert none is None and three == 3 and type(three) is int
    with torch.no_grad():
        torch.testing.assert_close(y, reference(x, negate=True)[0])
    # The caller's own tensors must be laid out as the package reads them: refused, not bound wrong.
    state = {k: v.contiguous() for k, v in reference.state_dict().items()}
    with pytest.raises(flashrt_build.WeightsMismatch, match=r"wrong strides: mix strides \[4, 1\] \(package expects"):
        flashrt_build.load(result.output_dir, weights=state)
    state["mix"] = reference.mix  # the build's layout
    torch.testing.assert_close(flashrt_build.load(result.output_dir, weights=state)(x)[0], y)


def test_a_host_or_mapping_in_another_layout_is_refused(mlp_external_build: flashrt_build.BuildResult) -> None:
    """Same shape, dtype and device, other strides: bound, it gave wrong outputs (max error 0.34 on the mlp)."""
    host = eager("+module=mlp")
    host.fc1.weight = torch.nn.Parameter(host.fc1.weight.detach().t().contiguous().t())
    with pytest.raises(flashrt_build.WeightsMismatch, match=r"wrong strides: fc1.weight strides \[1, 64\]"):
        flashrt_build.load(mlp_external_build.output_dir, host=host)


def test_values_outside_a_declared_range_are_refused_by_the_loaded_package(
    gpt2_build: flashrt_build.BuildResult,
) -> None:
    """A token id at the vocabulary size made the package abort() the process (SIGABRT)."""
    model = flashrt_build.load(gpt2_build.output_dir)
    assert model.manifest["inputs"][0]["low"] == 0 and model.manifest["inputs"][0]["high"] == 1000
    ids = torch.zeros(2, 8, dtype=torch.int64)
    ids[1, 5] = 1000
    with pytest.raises(
        ValueError, match=r"input 'input_ids' holds values from 0 to 1000; the package accepts 0 to 999"
    ):
        model(input_ids=ids)
    ids[1, 5] = -1
    with pytest.raises(ValueError, match="holds values from -1 to 0"):
        model(input_ids=ids)
    ids[1, 5] = 999
    assert model(input_ids=ids).logits.shape == (2, 8, 1000)


def test_the_key_and_the_manifest_describe_one_toolchain(mlp_build: flashrt_build.BuildResult) -> None:
    """One description (config/toolchain.py): the key hashes its key fields,
    the manifest records it whole, so the two cannot disagree (the CPU ISA
    once came from /proc/cpuinfo for one and from torch for the other)."""
    from flashrt_build.cache.key import key_fields
    from flashrt_build.config.toolchain import KEY_FIELDS

    manifest = mlp_build.manifest
    assert key_fields(manifest["toolchain"]) == manifest["key_ingredients"]["toolchain"]
    assert set(KEY_FIELDS) <= set(manifest["toolchain"]) and manifest["toolchain"]["torch"] == torch.__version__


def test_a_load_names_a_temp_dir_that_cannot_hold_the_package(
    mlp_build: flashrt_build.BuildResult, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flashrt_build.errors import ConfigError

    monkeypatch.setenv("TMPDIR", "/nonexistent")
    with pytest.raises(ConfigError, match=r"environment variable 'TMPDIR' = '/nonexistent': no such directory"):
        flashrt_build.load(mlp_build.output_dir)
