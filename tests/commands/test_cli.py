"""The command line through real subprocesses: exit codes 0/1/2 and messages."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from clitools import cli, module_conf

import flashrt_build
from flashrt_build.config.compose import compose
from flashrt_build.config.spec import resolve_spec
from flashrt_build.stages.export import export_module
from flashrt_build.stages.inputs import dynamic_shapes, make_inputs
from flashrt_build.stages.module import instantiate_module

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        ([], ["config key 'module'", "+module=NAME"]),
        (["+module=nope"], ["config group 'module' = 'nope': no such module config", "mlp", "gpt2_tiny"]),
        (["+module=mlp", "module.inputs.x.colour=red"], ["colour"]),
        (["+module=mlp", "seed=abc"], ["seed", "abc"]),
        (["+module=mlp", "module.inputs.x.dtype=float33"], ["module.inputs.x.dtype", "float33", "expected a dtype"]),
        # these two import torch (Inductor's options, the target's module): seconds each
        pytest.param(
            ["+module=mlp", "+inductor.options.max_autotun=true"],
            ["inductor.options.max_autotun", "max_autotune"],
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ["+module=mlp", "module.model._target_=nope.Missing"],
            ["module.model._target_", "nope.Missing", "imported"],
            marks=pytest.mark.slow,
        ),
        (["+module=mlp", "module.checkpoint=missing.safetensors"], ["module.checkpoint", "no such file"]),
        (["+module=mlp", "toolchain.cxx=no-such-g++"], ["toolchain.cxx", "no-such-g++", "no such compiler"]),
        (["+module=mlp", "+no_such_key=1"], ["config key 'no_such_key' = 1: not a config key; valid keys:"]),
        (["+module=mlp", "+inductr.options.max_autotune=true"], ["did you mean inductor.options.max_autotune?"]),
        (["+module=mlp", "output_dir=/proc/forbidden"], ["config key 'output_dir' = '/proc/forbidden': cannot be"]),
        (["+module=mlp", "--config-dir", "/nonexistent"], ["config key '--config-dir' = '/nonexistent': no such"]),
        (["+module=mlp", "--config-dir=README.md"], ["'--config-dir' = 'README.md': is a file, not a directory"]),
    ],
    ids=[
        "no-module",
        "unknown-module",
        "unknown-key",
        "wrong-type",
        "bad-dtype",
        "bad-option",
        "bad-target",
        "no-ckpt",
        "no-cxx",
        "typo-key",
        "typo-key-close",
        "output-dir-proc",
        "config-dir-missing",
        "config-dir-file",
    ],
)
def test_config_errors_exit_2_with_one_clear_message(tmp_path: Path, args: list[str], needles: list[str]) -> None:
    result = cli(*args, f"output_root={tmp_path}")
    assert result.returncode == 2, result.stderr
    output = result.stdout + result.stderr
    for needle in needles:
        assert needle in output
    assert "Traceback" not in output
    if "ConfigError" in result.stderr:  # ours, not Hydra's composition message
        assert len([line for line in result.stderr.splitlines() if "Error" in line]) == 1  # one line says why
    assert not any(p.name != ".runs" for p in tmp_path.iterdir())


def test_an_output_root_that_cannot_be_written_is_refused_by_name_creating_nothing(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("x")
    result = cli("+module=mlp", f"output_root={tmp_path / 'a-file' / 'root'}")
    assert result.returncode == 2
    assert "config key 'output_root'" in result.stderr and "a-file is a file, not a directory" in result.stderr
    assert "output_dir" not in result.stderr  # the derived dir fails with its root: one cause, one line
    assert [p.name for p in tmp_path.iterdir()] == ["a-file"]  # Hydra's logs went to the temp dir


@pytest.mark.slow
def test_export_failure_exits_1_naming_target_and_cause(tmp_path: Path) -> None:
    conf = module_conf(
        tmp_path,
        "branchy",
        "name: branchy\nmodel: {_target_: modules.DataDependentBranch}\ninputs: {x: {shape: [2, 4]}}\n",
    )
    result = cli("--config-dir", str(conf), "+module=branchy", f"output_root={tmp_path / 'out'}")
    assert result.returncode == 1, result.stderr
    assert "ExportError" in result.stderr and "modules.DataDependentBranch" in result.stderr
    assert "data-dependent" in result.stderr.lower() or "guard" in result.stderr.lower()
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out" / "branchy").exists() or not any((tmp_path / "out" / "branchy").iterdir())


@pytest.mark.slow
def test_constructor_failure_exits_1(tmp_path: Path) -> None:
    conf = module_conf(
        tmp_path, "broken", "name: broken\nmodel: {_target_: modules.RaisesInInit}\ninputs: {x: {shape: [2]}}\n"
    )
    result = cli("--config-dir", str(conf), "+module=broken", f"output_root={tmp_path / 'out'}")
    assert result.returncode == 1
    assert "constructing modules.RaisesInInit raised RuntimeError: this constructor always fails" in result.stderr


@pytest.mark.slow
def test_hydra_flags_work() -> None:
    job = cli("+module=mlp", "--cfg", "job")
    assert job.returncode == 0 and "_target_: flashrt_build.examples.MLP" in job.stdout
    helped = cli("--help")
    assert helped.returncode == 0
    modules = "bert_base, bert_tiny, causal_lm, gpt2_tiny, llama_1b, mlp, pretrained_gpt2, resnet50, t5_tiny, tiny_lm"
    assert f"module: {modules}" in helped.stdout
    script = Path(sys.executable).parent / "flashrt-build"
    assert subprocess.run([str(script), "--help"], capture_output=True, timeout=60).returncode == 0


@pytest.mark.slow
def test_user_module_builds_from_config_dir_with_positional_input_and_dict_output(tmp_path: Path) -> None:
    """A positional input is passed by its place: its name (`features`, for
    the forward's `x`) is a label, which a build once held against the forward."""
    conf = module_conf(
        tmp_path,
        "two",
        "name: two\nmodel: {_target_: modules.TwoInputs}\ninputs:\n"
        "  features: {shape: [3, 4], positional: true, dynamic: {0: {name: batch, min: 1, max: 32}}}\n"
        "  scale: {shape: [3, 1], dynamic: {0: {name: batch, min: 1, max: 32}}}\n",
    )
    out = tmp_path / "artifact"
    result = cli("--config-dir", str(conf), "+module=two", f"output_dir={out}", f"output_root={tmp_path / 'root'}")
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip().splitlines()[-1].endswith(f"artifact: {out}")
    for stage in ("instantiate", "export", "compile", "package", "verify", "manifest"):
        assert f"- {stage} " in result.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert [o["shape"] for o in manifest["outputs"]] == [["batch", 4], ["batch", 4]]

    model = flashrt_build.load(out)
    spec = resolve_spec(compose(["+module=two"], config_dir=conf))
    reference = instantiate_module(spec)
    x, scale = torch.randn(5, 4), torch.randn(5, 1)
    got, want = model(x, scale=scale), reference(x, scale=scale)
    assert set(got) == {"y", "scaled"}
    torch.testing.assert_close(got["scaled"], want["scaled"])


@pytest.mark.slow
def test_multirun_builds_each_variant_into_its_own_dir(tmp_path: Path) -> None:
    result = cli("-m", "+module=mlp", "seed=0,1", f"output_root={tmp_path}", "verify.enabled=false")
    assert result.returncode == 0, result.stderr
    dirs = sorted(p.name for p in (tmp_path / "mlp").iterdir() if not p.name.startswith("."))
    assert dirs == ["cpu-baked-default", "cpu-baked-default-seed_1"]  # seed=0 is the default: no suffix
    hashes = {json.loads((tmp_path / "mlp" / d / "manifest.json").read_text())["package"]["sha256"] for d in dirs}
    assert len(hashes) == 2
    unverified = json.loads((tmp_path / "mlp" / dirs[0] / "manifest.json").read_text())["verification"]
    assert unverified["passed"] is None and unverified["enabled"] is False


def test_is_exporting_is_true_only_while_tracing() -> None:
    import modules

    spec = resolve_spec(compose(["+module=mlp"]))
    module = modules.CountsCalls().eval()
    example = make_inputs(spec, sizes={"batch": 2})
    example.kwargs["x"] = torch.randn(2, 4)
    export_module(module, spec, example, dynamic_shapes(spec, example))
    assert module.calls == 0 and not flashrt_build.is_exporting()
    module(torch.randn(2, 4))
    assert module.calls == 1
    assert instantiate_module  # imported for the other tests; keeps ruff honest
