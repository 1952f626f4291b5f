"""Bad input, interrupted builds, concurrent builds, tampered artifacts."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import flashrt_build
from flashrt_build.runtime.hashing import file_sha256


def cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flashrt_build", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def user_module(tmp_path: Path, target: str, inputs: str = "{x: {shape: [2, 4]}}") -> Path:
    conf = tmp_path / "conf"
    (conf / "module").mkdir(parents=True, exist_ok=True)
    (conf / "module" / "mine.yaml").write_text(f"name: mine\nmodel: {{_target_: {target}}}\ninputs: {inputs}\n")
    return conf


def assert_nothing_built(root: Path) -> None:
    leftovers = [p for p in root.rglob("*") if p.is_file() and ".runs" not in p.parts and p.suffix != ".lock"]
    assert leftovers == []


@pytest.mark.parametrize(
    ("args", "code", "needles"),
    [
        (["module.inputs.x.shape=[0,16]"], 2, ["module.inputs.x.shape", "[0, 16]", "positive"]),
        (["module.inputs.x.shape=[4,-16]"], 2, ["module.inputs.x.shape", "positive"]),
        (["module.inputs.x.dynamic={0: {min: 8, max: 2}}"], 2, ["module.inputs.x.dynamic.0", "min <= max"]),
        (["module.inputs.x.shape=[100,16]"], 2, ["module.inputs.x.shape", "outside its dynamic range [1, 64]"]),
        (["module.name=../../etc"], 2, ["module.name", "../../etc"]),
        pytest.param(["target=cuda"], 2, ["target.device", "no CUDA device"], marks=pytest.mark.slow),  # asks torch
        (["allowed_targets=[transformers.*]"], 2, ["module.model._target_", "allowed_targets"]),
    ],
    ids=["zero-dim", "negative-dim", "min-above-max", "outside-range", "escape", "no-cuda", "not-allowed"],
)
def test_bad_values_through_the_cli(tmp_path: Path, args: list[str], code: int, needles: list[str]) -> None:
    if "target=cuda" in args and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    result = cli("+module=mlp", *args, f"output_root={tmp_path}")
    assert result.returncode == code, result.stderr
    for needle in needles:
        assert needle in result.stderr
    assert "Traceback" not in result.stderr
    assert_nothing_built(tmp_path)


@pytest.mark.slow
def test_a_forward_that_raises_on_the_example_inputs(tmp_path: Path) -> None:
    conf = user_module(tmp_path, "modules.RaisesInForward")
    result = cli("--config-dir", str(conf), "+module=mine", f"output_root={tmp_path / 'out'}")
    assert result.returncode == 1
    assert "the forward of modules.RaisesInForward raises RuntimeError on the example inputs {'x': [2, 4]}" in (
        result.stderr
    )
    assert_nothing_built(tmp_path / "out")


@pytest.mark.slow
def test_a_forward_that_only_a_quantized_module_refuses_names_the_recipe(tmp_path: Path) -> None:
    conf = user_module(tmp_path, "modules.ReadsItsWeight")
    result = cli("--config-dir", str(conf), "+module=mine", "quant=int8_wo", f"output_root={tmp_path / 'out'}")
    assert result.returncode == 1
    assert "the forward of modules.ReadsItsWeight raises NotImplementedError on the example inputs" in result.stderr
    assert "(check module.inputs, or quant 'int8_wo', which quantized the module before this call)" in result.stderr
    assert_nothing_built(tmp_path / "out")


@pytest.mark.slow
def test_a_quantized_layer_that_fails_is_named_with_the_rule_that_keeps_it(tmp_path: Path) -> None:
    conf = user_module(tmp_path, "modules.WeightNormedHead")
    result = cli("--config-dir", str(conf), "+module=mine", "quant=int8_wo", f"output_root={tmp_path / 'out'}")
    assert result.returncode == 1
    assert "the forward of modules.WeightNormedHead raises NotImplementedError in head on the example inputs" in (
        result.stderr
    )
    assert (
        "or quant 'int8_wo', which quantized head: a rule {pattern: 'head', config: skip} before the others keeps it"
        in result.stderr
    )
    assert_nothing_built(tmp_path / "out")


@pytest.mark.slow
def test_a_checkpoint_whose_keys_do_not_match(tmp_path: Path) -> None:
    save_file({"fc1.weight": torch.zeros(64, 16), "bogus": torch.zeros(1)}, str(tmp_path / "bad.safetensors"))
    result = cli("+module=mlp", f"module.checkpoint={tmp_path / 'bad.safetensors'}", f"output_root={tmp_path / 'o'}")
    assert result.returncode == 2
    assert "module.checkpoint" in result.stderr and "6 missing: fc1.bias, fc2.bias, fc2.weight" in result.stderr
    assert "1 unexpected: bogus" in result.stderr
    assert_nothing_built(tmp_path / "o")


def test_an_output_dir_that_cannot_be_written(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    result = cli("+module=mlp", f"output_dir={tmp_path / 'a-file' / 'build'}", f"output_root={tmp_path}")
    assert result.returncode == 2
    assert "config key 'output_dir'" in result.stderr and "a-file is a file, not a directory" in result.stderr
    assert "instantiate" not in result.stderr  # refused before any work


def test_a_manifest_that_does_not_parse_or_is_foreign_is_refused(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(flashrt_build.ArtifactError, match="is not valid JSON"):
        flashrt_build.load(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"schema": "someone-else/3"}))
    with pytest.raises(
        flashrt_build.ArtifactError, match="has schema 'someone-else/3', expected 'flashrt_build.manifest/1'"
    ):
        flashrt_build.load(tmp_path)


def _killed_build(output_dir: Path, root: Path, after: str) -> None:
    """Start a real build and SIGKILL its whole process group once `after` is logged."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flashrt_build",
            "+module=mlp",
            f"output_dir={output_dir}",
            f"output_root={root}",
            "force=true",
        ],  # the artifact in place is up to date: make it work
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    assert proc.stderr is not None
    for line in proc.stderr:
        if f"- {after} " in line:
            os.killpg(proc.pid, signal.SIGKILL)
            break
    proc.wait(timeout=120)
    assert proc.returncode == -signal.SIGKILL, f"the build finished before '{after}' was logged"


@pytest.mark.slow
def test_a_build_killed_at_any_stage_leaves_the_previous_artifact(
    tmp_path: Path, mlp_build: flashrt_build.BuildResult
) -> None:
    out = tmp_path / "mlp"
    shutil.copytree(mlp_build.output_dir, out)
    before = {p.name: file_sha256(p) for p in out.iterdir()}
    for stage in ("instantiate", "compile", "package"):
        _killed_build(out, tmp_path, stage)
        assert {p.name: file_sha256(p) for p in out.iterdir()} == before, f"killed after {stage}"
        flashrt_build.load(out)  # still a complete, loadable artifact
    assert list(tmp_path.glob(".staging-*"))  # a kill leaves staging behind...
    result = cli("+module=mlp", f"output_dir={out}", f"output_root={tmp_path}")
    assert result.returncode == 0, result.stderr
    assert "up to date" in result.stderr and "left by an interrupted build" in result.stderr
    assert not list(tmp_path.glob(".staging-*"))  # ...and the next build removes it
    assert json.loads((out / "manifest.json").read_text())["verification"]["passed"] is True


@pytest.mark.slow
def test_concurrent_builds_of_one_config_both_succeed_and_others_run_alongside(tmp_path: Path) -> None:
    same = [sys.executable, "-m", "flashrt_build", "+module=mlp", f"output_root={tmp_path}", "verify.repeat=0"]
    other = [*same, "seed=1"]
    procs = [
        subprocess.Popen(c, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True) for c in (same, same, other)
    ]
    logs = [p.communicate(timeout=600)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], logs
    assert sum("waiting for another build" in log for log in logs[:2]) == 1
    assert "waiting for another build" not in logs[2]
    for leaf in ("cpu-baked-default", "cpu-baked-default-seed_1"):
        model = flashrt_build.load(tmp_path / "mlp" / leaf)
        assert model(torch.randn(2, 16)).shape == (2, 8)
    assert not list((tmp_path / "mlp").glob(".staging-*"))
