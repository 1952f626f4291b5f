"""A graph pass holds the core's promises: the package is verified against
the module as the user gave it (a pass that changes the answer fails the
build), a layer the pass cannot rewrite faithfully is left as it is and
said so, and a pass that rewrote nothing leaves the build key as it was."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

import flashrt_build
from flashrt_build.cache.plan import make_plan
from flashrt_build.config.compose import compose
from flashrt_build.errors import VerifyError
from flashrt_build.stages import passes
from flashrt_build.stages.module import instantiate_stage

X = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))


def hooked_conf(root: Path) -> Path:
    conf = root / "conf"
    (conf / "module").mkdir(parents=True, exist_ok=True)
    (conf / "module" / "hooked.yaml").write_text(
        "name: hooked\nmodel: {_target_: modules.HookedProjections, kind: forward_hook}\n"
        "inputs: {x: {shape: [3, 8], dynamic: {0: {name: batch, min: 1, max: 8}}}}\n"
    )
    return conf


def passed(root: Path, kind: str) -> tuple[nn.Module, nn.Module, dict, str]:
    """The module of `kind` before and after `passes=llm`, the passes' record and log note."""
    cfg = compose(["+module=hooked", f"module.model.kind={kind}", "passes=llm"], config_dir=hooked_conf(root))
    plan = make_plan(cfg)
    module = instantiate_stage(plan.spec, plan.digests).value
    original = copy.deepcopy(module)
    stage = passes.passes_stage(module, plan.spec)
    return original, module, stage.sections["passes"], stage.note


@pytest.mark.parametrize(
    ("kind", "why"),
    [
        ("forward_hook", "has a forward hook or pre-hook"),
        ("pre_hook", "has a forward hook or pre-hook"),
        ("subclass", "is a _OwnForwardLinear, which overrides nn.Linear's forward"),
        ("parametrized", "has a weight of Tensor (a parametrization, a tensor subclass)"),
        ("instance_forward", "has a forward of its own, set on the layer itself"),
    ],
)
def test_a_layer_a_fused_matmul_would_not_reproduce_is_left_as_it_is_and_said(
    tmp_path: Path, kind: str, why: str
) -> None:
    original, module, record, note = passed(tmp_path, kind)
    fused = record["fuse_projections"]
    assert fused["fused"] == [] and fused["linear_calls_cut"] == 0
    assert [entry["layers"] for entry in fused["left"]] == [["q_proj"]]
    assert fused["left"][0]["why"].startswith(f"q_proj {why}")
    assert "nothing to fuse" in note and f"1 group(s) left unfused: q_proj {why}" in note
    assert passes.idle_passes(make_plan(compose(["+module=mlp", "passes=llm"])).spec, record) >= {"fuse_projections"}
    with torch.no_grad():
        assert torch.equal(module(X), original(X))


def test_the_same_layers_without_a_hook_are_fused(tmp_path: Path) -> None:
    original, module, record, _ = passed(tmp_path, "none")
    assert [g["weight"] for g in record["fuse_projections"]["fused"]] == ["q_proj__k_proj.weight"]
    assert record["fuse_projections"]["left"] == []
    with torch.no_grad():
        torch.testing.assert_close(module(X), original(X))


def test_code_that_reads_a_fused_layers_tensors_reads_its_rows(tmp_path: Path) -> None:
    """A module that reads `self.k_proj.weight` beside calling it: the slice
    standing for k_proj serves its rows of the fused tensors (it raised
    AttributeError at export, blamed on the inputs)."""
    original, module, record, _ = passed(tmp_path, "reads_weight")
    assert [g["weight"] for g in record["fuse_projections"]["fused"]] == ["q_proj__k_proj.weight"]
    assert torch.equal(module.k_proj.weight, original.k_proj.weight) and module.k_proj.out_features == 8
    with torch.no_grad():
        torch.testing.assert_close(module(X), original(X))


def test_the_reference_runs_on_copies_of_the_inputs(tmp_path: Path) -> None:
    """A module that writes into its input: the calls the package is given
    are as they were drawn, not as the eager reference left them."""
    from flashrt_build.stages.reference import plan_calls, reference_stage

    cfg = compose(["+module=hooked", "module.model.kind=writes_input"], config_dir=hooked_conf(tmp_path))
    plan = make_plan(cfg)
    module = instantiate_stage(plan.spec, plan.digests).value
    referenced = reference_stage(module, plan.spec).value.calls
    for call, drawn in zip(referenced, plan_calls(plan.spec, plan.spec.repeat), strict=True):  # the same seeds
        assert all(torch.equal(call.inputs[name], drawn.inputs[name]) for name in drawn.inputs), call.label


def test_a_global_forward_hook_keeps_every_layer_apart(tmp_path: Path) -> None:
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: None)
    try:
        _, _, record, _ = passed(tmp_path, "none")
    finally:
        handle.remove()
    fused = record["fuse_projections"]
    assert fused["fused"] == [] and {tuple(e["layers"]) for e in fused["left"]} == {("q_proj",), ("k_proj",)}
    assert "global forward hook" in fused["left"][0]["why"]


def test_every_pass_switch_says_whether_it_rewrote() -> None:
    """A switch without a rule would always count as rewriting, keying its idle builds apart."""
    from flashrt_build.config.schema import PASS_SWITCHES

    assert set(passes.REWROTE) == set(PASS_SWITCHES)


@pytest.fixture(scope="module")
def hooked_builds(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, flashrt_build.BuildResult]]:
    """`hooked` without passes (one compile), then with `passes=llm`, which fuses nothing."""
    root = tmp_path_factory.mktemp("hooked")
    conf = hooked_conf(root)
    builds = {}
    for passes_group in ("none", "llm"):
        cfg = compose(["+module=hooked", f"passes={passes_group}", f"output_root={root / 'out'}"], config_dir=conf)
        builds[passes_group] = flashrt_build.build(cfg)
    return conf, builds


@pytest.mark.slow
def test_a_pass_that_rewrote_nothing_is_the_build_without_it(
    hooked_builds: tuple[Path, dict[str, flashrt_build.BuildResult]],
) -> None:
    """No second compile: the build key is the unpassed build's, its artifact
    linked from the store; the next run is up to date without running the passes."""
    conf, builds = hooked_builds
    plain, passed_build = builds["none"], builds["llm"]
    assert plain.status == "built" and passed_build.status == "from_store"
    assert passed_build.output_dir.name.endswith("-llm") and passed_build.output_dir != plain.output_dir
    manifest = passed_build.manifest
    assert manifest["build_key"] == plain.manifest["build_key"]
    assert manifest["config"]["passes"]["fuse_projections"] is True and "fuse_projections" in manifest["passes"]["idle"]
    assert manifest["passes"]["fuse_projections"]["left"][0]["layers"] == ["q_proj"]
    assert (passed_build.output_dir / "model.pt2").stat().st_ino == (plain.output_dir / "model.pt2").stat().st_ino
    cfg = compose(["+module=hooked", "passes=llm", f"output_root={plain.output_dir.parents[1]}"], config_dir=conf)
    assert flashrt_build.build(cfg).status == "up_to_date"
    model = flashrt_build.load(passed_build.output_dir)
    eager = flashrt_build.load(plain.output_dir)
    assert torch.equal(model(X), eager(X))


@pytest.mark.slow
def test_a_pass_that_changes_the_answer_fails_verification_and_publishes_nothing(
    hooked_builds: tuple[Path, dict[str, flashrt_build.BuildResult]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fusion as it was before hooks were looked at: q's hook is lost, the
    package differs from the module as given, and verification (against that
    module, not the rewritten one) says so; the artifact in place stays."""
    conf, builds = hooked_builds
    monkeypatch.setattr(passes, "unfaithful", lambda layer: None)
    out = builds["llm"].output_dir
    before = (out / "manifest.json").read_bytes()
    cfg = compose(["+module=hooked", "passes=llm", f"output_root={out.parents[1]}", "force=true"], config_dir=conf)
    with pytest.raises(VerifyError, match=r"package output output differs from eager at example: max_abs_err="):
        flashrt_build.build(cfg)
    assert (out / "manifest.json").read_bytes() == before
