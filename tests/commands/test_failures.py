"""Wrong input and faults through the real command line: exit 2 for what is
checked before work, 1 for a build that failed, 130/143 when interrupted;
one line that names the key or the file, no traceback, nothing left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from clitools import QUIET, cli, module_conf, mounted
from safetensors.torch import save_file

import flashrt_build


def one_line_error(stderr: str) -> str:
    """The error line; asserts there is exactly one and no traceback."""
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if "ERROR" in line or line.startswith(("error:", "ConfigError"))]
    assert len(errors) == 1, stderr
    return errors[0]


def built_files(root: Path) -> list[Path]:
    """What a build left under its output root (Hydra's run logs and lock files aside)."""
    return [p for p in root.rglob("*") if p.is_file() and ".runs" not in p.parts and p.suffix != ".lock"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A truncated safetensors file, a text file named like one, and one named .pt."""
    folder = tmp_path_factory.mktemp("bad-checkpoints")
    whole = folder / "whole.safetensors"
    save_file({"fc1.weight": torch.zeros(64, 16), "fc1.bias": torch.zeros(64)}, str(whole))
    truncated = folder / "truncated.safetensors"
    truncated.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    text = folder / "notes.safetensors"
    text.write_text("hello world\n")
    pt = folder / "notes.pt"
    pt.write_text("hello world\n")
    return {"truncated": truncated, "text": text, "pt": pt}


@pytest.mark.parametrize(
    ("which", "needle"),
    [
        ("truncated", "is a truncated safetensors file: its header places tensor data up to byte 4352"),
        ("text", "is not a safetensors file: its first bytes b'hello wo' are no header length followed by JSON"),
        ("pt", "is neither a safetensors file nor a torch checkpoint (it begins with b'hello wo')"),
    ],
)
def test_a_checkpoint_that_is_not_one_is_refused_before_work(
    tmp_path: Path, checkpoints: dict[str, Path], which: str, needle: str
) -> None:
    result = cli("+module=mlp", f"module.checkpoint={checkpoints[which]}", f"output_root={tmp_path}")
    assert result.returncode == 2
    line = one_line_error(result.stderr)
    assert f"config key 'module.checkpoint' = '{checkpoints[which]}'" in line and needle in line
    assert "instantiate" not in result.stderr and built_files(tmp_path) == []


@pytest.mark.slow
def test_config_time_refusals_name_the_key_or_variable(tmp_path: Path) -> None:
    """A compiler that is not there ($CXX), a temp dir that is not there, a
    CPU level the compiler rejects (its own words, whole), a YAML syntax error
    in the user's config dir: exit 2 before work, one line each."""
    broken = module_conf(tmp_path, "broken", "name: broken\nmodel: {_target_: modules.TwoInputs\ninputs: [\n")
    cases = [
        (["+module=mlp"], {"CXX": "/nonexistent/g++"}, "environment variable 'CXX' = '/nonexistent/g++'"),
        (["+module=mlp"], {"TMPDIR": str(tmp_path / "no-such-tmp")}, "environment variable 'TMPDIR'"),
        (["+module=mlp", "target.march=banana"], {}, "-march=banana: cc1plus: error: bad value"),
        (["--config-dir", str(broken), "+module=broken"], {}, f"{broken / 'module' / 'broken.yaml'} is not valid YAML"),
    ]
    for args, env, needle in cases:
        result = cli(*args, f"output_root={tmp_path / 'out'}", env=env)
        assert result.returncode == 2, result.stderr
        assert needle in one_line_error(result.stderr)
        assert not (tmp_path / "out").exists() or built_files(tmp_path / "out") == []
    assert "config key 'target.march' = 'banana'" in cli("+module=mlp", "target.march=banana").stderr


@pytest.mark.slow
def test_a_full_temp_dir_is_named_not_the_compiler(tmp_path: Path) -> None:
    """The one-line compile probe failed for want of space: it was reported against toolchain.cxx."""
    with mounted(tmp_path / "tmp", "size=64k") as full:
        _fill(full)
        result = cli("+module=mlp", f"output_root={tmp_path / 'out'}", env={"TMPDIR": str(full)})
    assert result.returncode == 2, result.stderr
    line = one_line_error(result.stderr)
    assert f"environment variable 'TMPDIR' = '{full}': has no space left" in line and "toolchain.cxx" not in line


def _fill(directory: Path) -> None:
    """Write into `directory` until its filesystem is full."""
    try:
        with open(directory / "fill", "wb", buffering=0) as f:
            while True:
                f.write(b"\0" * 4096)
    except OSError:  # full
        pass


@pytest.mark.slow
def test_an_example_input_too_large_to_allocate_fails_naming_it(tmp_path: Path) -> None:
    result = cli("+module=mlp", "module.inputs.x.shape=[4,100000000000]", f"output_root={tmp_path}")
    assert result.returncode == 1
    line = one_line_error(result.stderr)
    assert "could not allocate the example input module.inputs.x of shape [4, 100000000000] (1.6e+03 GB)" in line
    assert built_files(tmp_path) == []


@pytest.mark.slow
def test_an_unexpected_error_is_one_line_and_exit_1(tmp_path: Path) -> None:
    conf = module_conf(
        tmp_path, "odd", "name: odd\nmodel: {_target_: modules.RaisesInEval}\ninputs: {x: {shape: [2, 4]}}\n"
    )
    result = cli("--config-dir", str(conf), "+module=odd", f"output_root={tmp_path / 'out'}")
    assert result.returncode == 1
    line = one_line_error(result.stderr)
    assert "UnexpectedError: LookupError: no such training mode (at " in line and "modules.py:" in line
    traced = cli(
        "--config-dir", str(conf), "+module=odd", f"output_root={tmp_path / 'out'}", env={"FLASHRT_TRACEBACK": "1"}
    )
    assert traced.returncode == 1 and "Traceback" in traced.stderr  # when asked for


@pytest.mark.slow
def test_input_ranges_the_model_cannot_take_are_config_errors_before_the_compile(tmp_path: Path) -> None:
    """Token ids above the vocabulary, a sequence beyond the model's positions:
    eager runs at the ends of the declared ranges first and names the key."""
    conf = tmp_path / "conf" / "module"
    conf.mkdir(parents=True)
    (conf / "ids.yaml").write_text(
        "defaults: [gpt2_tiny, _self_]\nname: ids\n"
        "inputs: {input_ids: {shape: [2, 32], dtype: int64, low: 0, high: 2000}}\n"
    )
    (conf / "long.yaml").write_text(
        "defaults: [gpt2_tiny, _self_]\nname: long\ninputs:\n"
        "  input_ids: {shape: [2, 32], dtype: int64, low: 0, high: 1000, dynamic: {1: {name: seq, min: 2, max: 500}}}\n"
    )
    (conf / "typo.yaml").write_text(
        "name: typo\nmodel: {_target_: modules.Vision}\ninputs: {pixel_value: {shape: [2, 3]}}\n"
    )
    cases = {
        # the submodule that raised is named: the token embedding for ids, the position one for length
        "ids": "config key 'module.inputs.input_ids.high' = 2000: the eager forward raises IndexError in "
        "transformer.wte: index out of range in self on the value 1999",
        "long": "config key 'module.inputs.input_ids.dynamic.1.max' = 500: the eager forward raises IndexError in "
        "transformer.wpe:",
        "typo": "config key 'module.inputs.pixel_value' = 'pixel_value': Vision.forward has no parameter "
        "'pixel_value'; did you mean 'pixel_values'?",
    }
    for name, needle in cases.items():
        result = cli("--config-dir", str(conf.parent), f"+module={name}", f"output_root={tmp_path / 'out'}")
        assert result.returncode == 2, result.stderr
        assert needle in one_line_error(result.stderr)
        assert "- export " not in result.stderr and "- compile " not in result.stderr


@pytest.mark.slow
def test_a_full_disk_fails_the_build_with_exit_1_and_leaves_nothing(tmp_path: Path) -> None:
    """The package writer used to abort the process (exit 134) when its disk filled."""
    with mounted(tmp_path / "full", "size=1m") as mount:
        result = cli("+module=mlp", f"output_root={mount}", "verify.enabled=false")
        assert result.returncode == 1, result.stderr[-2000:]
        line = one_line_error(result.stderr)
        assert "writing the package to" in line and "No space left on device" in line
        assert built_files(mount) == [] and not list((mount / "mlp").glob(".staging-*"))


@pytest.mark.slow
def test_a_package_that_aborts_during_verification_says_where_and_why(tmp_path: Path) -> None:
    conf = module_conf(
        tmp_path,
        "aborts",
        "name: aborts\nmodel: {_target_: modules.AbortsWhenCompiled}\n"
        "inputs: {ids: {shape: [64, 256], dtype: int64, low: 0, high: 10}}\n",  # big enough for threads
    )
    result = cli("--config-dir", str(conf), "+module=aborts", f"output_root={tmp_path / 'out'}", "verify.repeat=0")
    assert result.returncode == 1
    line = one_line_error(result.stderr)
    assert "LoaderCrash: the package crashed its process with SIGABRT at call 'example' (ids [64, 256]): " in line
    assert "index out of bounds: 0 <= " in line and " < 10L" in line  # the package's own check, in its words
    assert "toolchain.cxx" not in line  # the compiler is not to blame: doctor passes
    assert built_files(tmp_path / "out") == []


@pytest.mark.slow
def test_check_repro_and_store_say_when_they_cannot_check(tmp_path: Path) -> None:
    def tool(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=300)

    (tmp_path / "notes.txt").write_text("hello")
    not_a_build = tool("flashrt_build.check", str(tmp_path), str(tmp_path / "notes.txt"))
    assert not_a_build.returncode == 2 and "cannot check" in not_a_build.stderr
    assert "holds no complete build" in not_a_build.stderr
    assert tool("flashrt_build.repro", str(tmp_path)).returncode == 2
    missing_root = tool("flashrt_build.store", "clean", str(tmp_path / "none"))
    assert missing_root.returncode == 2 and "no such output root" in missing_root.stderr


@pytest.mark.slow
def test_check_names_its_argument_for_a_file_that_is_no_checkpoint(
    mlp_external_build: flashrt_build.BuildResult, tmp_path: Path
) -> None:
    (tmp_path / "notes.safetensors").write_text("hello world")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "flashrt_build.check",
            str(mlp_external_build.output_dir),
            str(tmp_path / "notes.safetensors"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    assert "argument 'CHECKPOINT'" in result.stderr and "module.checkpoint" not in result.stderr
    with pytest.raises(flashrt_build.ConfigError, match=r"argument 'weights' = .*is not a safetensors file"):
        flashrt_build.load(mlp_external_build.output_dir, weights=tmp_path / "notes.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_an_interrupted_build_says_so_in_one_line_and_removes_its_staging(tmp_path: Path, signum: int) -> None:
    """Ctrl-C (SIGINT to the process group) printed a 120-line traceback; SIGTERM left a staging directory;
    once in CI, SIGTERM during the compile ended in SIGABRT (-6) instead of 143, its output unkept: an
    interrupted command now skips the interpreter's teardown of what the signal left half-made
    (errors.exit_interrupted), and a crash here shows its stack and the command's last words."""
    out = tmp_path / "mlp"
    proc = subprocess.Popen(
        [sys.executable, "-m", "flashrt_build", "+module=mlp", f"output_dir={out}", f"output_root={tmp_path}"],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
        env={**os.environ, **QUIET, "PYTHONFAULTHANDLER": "1"},  # a crash shows where it happened
    )
    assert proc.stderr is not None
    for line in proc.stderr:
        if "- export " in line:  # compiling now: the staging directory exists
            time.sleep(1)
            assert list(tmp_path.glob(".staging-*"))
            if signum == signal.SIGINT:
                os.killpg(proc.pid, signum)  # what a terminal's Ctrl-C does
            else:
                proc.send_signal(signum)
            break
    rest = proc.stderr.read()
    assert proc.wait(timeout=120) == 128 + signum, rest
    assert "Traceback" not in rest
    assert rest.strip().splitlines()[-1] == (
        f"interrupted by {signal.Signals(signum).name}: nothing was published; an earlier artifact at the output "
        "directory is as it was"
    )
    assert not list(tmp_path.glob(".staging-*")) and not out.exists()


def test_a_signal_wins_over_the_error_it_caused_and_waits_for_cleanup_to_finish() -> None:
    """CI: Ctrl-C killed the compiler first; its error reached the build before the signal did, and the
    build exited 1 ('failed') instead of 130 ('interrupted'). A signal during cleanup could cut it short."""
    script = """
import os, signal
from flashrt_build.errors import Interrupted, cleanup_uninterrupted, interrupted_instead, stop_on_signals
stop_on_signals()
steps = []
try:
    try:
        raise RuntimeError("the compiler died of the same Ctrl-C")
    finally:
        with cleanup_uninterrupted():
            os.kill(os.getpid(), signal.SIGINT)
            steps.append("cleaned up")
except Interrupted as stopped:
    print(steps, stopped.exit_code, type(stopped.__context__).__name__)
try:
    raise OSError("a worker's pipe broke")
except OSError as exc:
    try:
        interrupted_instead(exc)
    except Interrupted as stopped:
        print(stopped.exit_code, type(stopped.__cause__).__name__)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["['cleaned up'] 130 RuntimeError", "130 OSError"]


def test_an_interrupted_command_ends_without_the_interpreters_teardown_but_says_everything() -> None:
    """The teardown of what a signal left half-made can abort the process (CI: SIGABRT, not 143), so an
    interrupted command ends at once; what it had written to its buffered streams still comes out."""
    script = """
import atexit, logging, sys
from flashrt_build.errors import Interrupted, exit_interrupted
logging.basicConfig(stream=sys.stdout, format="%(message)s")
atexit.register(print, "teardown ran")
sys.stdout.write("buffered, ")
logging.getLogger("x").error("logged")
exit_interrupted(Interrupted(15), print)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 143, done.stderr
    assert done.stdout.splitlines() == [
        "buffered, logged",
        "interrupted by SIGTERM: nothing was published; an earlier artifact at the output directory is as it was",
    ]


@pytest.mark.slow
def test_a_manifest_that_cannot_be_trusted_is_refused(
    mlp_external_build: flashrt_build.BuildResult, tmp_path: Path
) -> None:
    """Editing weights.mode made the first call segfault; raising a dynamic max let out-of-range inputs through."""
    import shutil

    cases = {
        "mode": (lambda m: m["weights"].update(mode="baked"), 'was edited after its build: weights.mode is "baked"'),
        "max": (
            lambda m: m["inputs"][0]["dynamic"]["0"].update(max=4096),
            "inputs[0].dynamic.0.max is 4096 in it, 64 in the package's own record",
        ),
        "bogus": (
            lambda m: m["weights"].update(mode="sideways"),
            "weights.mode is 'sideways', expected baked or external",
        ),
        "missing": (lambda m: m.pop("inputs"), "inputs is missing; the manifest cannot be trusted"),
        "type": (
            lambda m: m["weights"]["tensors"][0].update(shape="big"),
            "weights.tensors[0].shape is 'big', expected array",
        ),
        "escape": (
            lambda m: m["package"].update(file="../model.pt2"),
            "package.file is '../model.pt2', expected a file",
        ),
    }
    for name, (edit, needle) in cases.items():
        copy = tmp_path / name
        shutil.copytree(mlp_external_build.output_dir, copy)
        manifest = json.loads((copy / "manifest.json").read_text())
        edit(manifest)
        (copy / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(flashrt_build.ArtifactError) as refused:
            flashrt_build.load(copy)
        assert needle in str(refused.value), name
