"""A new user's first hour: typos get the tool's one line, output folders are
predictable and the same from the API as from the command line, the API
reports progress, and a loaded package says what it is."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from clitools import cli, module_conf

import flashrt_build
from flashrt_build.config.compose import compose
from flashrt_build.config.spec import resolve_spec


@pytest.mark.parametrize(
    ("args", "yaml", "said"),
    [
        (["weigths=external"], None, "config key 'weigths' = 'external': not a config key; did you mean weights?"),
        (["module.checkpint=ckpt.pt"], None, "'module.checkpint' = 'ckpt.pt': not a config key; did you mean "
                                             "module.checkpoint?"),
        (["verify.repet=2"], None, "config key 'verify.repet' = '2': not a config key; did you mean verify.repeat?"),
        ([], "inputs: {x: {shape: [4, 16], dynamc: {0: {min: 1, max: 8}}}}",
         "'module.inputs.x.dynamc.0' = {'min': 1, 'max': 8}: not a config key; did you mean "
         "module.inputs.x.dynamic.0? (in module/mlp2.yaml)"),  # the value as the file gives it
    ],
    ids=["group-key", "module-key", "nested-key", "yaml-key"],
)  # fmt: skip
def test_a_typo_without_plus_gets_one_line_and_did_you_mean(
    tmp_path: Path, args: list[str], yaml: str | None, said: str
) -> None:
    module = ["+module=mlp"]
    if yaml is not None:
        conf = module_conf(tmp_path, "mlp2", f"name: mlp2\nmodel: {{_target_: flashrt_build.examples.MLP}}\n{yaml}\n")
        module = ["--config-dir", str(conf), "+module=mlp2"]
    result = cli(*module, *args, f"output_root={tmp_path / 'out'}")
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("ConfigError: ") and said in line


RAISES = "name: mine\nmodel: {_target_: modules.RaisesInInit}\ninputs: {x: {shape: [2, 4]}}\n"


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        ["seed=0"],
        ["seed=1"],
        ["module.checkpoint=CKPT"],
        ["release=true", "allowed_targets=[modules.*]"],
        ["weights=external", "target.dtype=bfloat16", "threads=1", "verify.atol=0.1"],
    ],
    ids=["default-seed", "seed", "checkpoint", "release", "several"],
)
def test_output_folders_are_the_same_from_the_cli_and_the_api(tmp_path: Path, overrides: list[str]) -> None:
    """The CLI's folder is read from its log (`building ... -> DIR`, before a
    module that cannot be constructed fails); the API's from compose()."""
    ckpt = tmp_path / "ckpt" / "cnn_step5.safetensors"
    ckpt.parent.mkdir()
    ckpt.write_bytes(b"")  # never read: the module fails first
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(1)}, str(ckpt))
    overrides = [o.replace("CKPT", str(ckpt)) for o in overrides]
    conf = module_conf(tmp_path, "mine", RAISES)
    common = ["+module=mine", *overrides, f"output_root={tmp_path / 'out'}"]
    result = cli("--config-dir", str(conf), *common, cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    (cli_dir,) = re.findall(r"building mine .* -> (\S+)", result.stderr)
    api_dir = resolve_spec(compose(common, config_dir=conf), cwd=tmp_path).output_dir
    assert Path(cli_dir) == api_dir
    expected = {
        "default-seed": "cpu-baked-default",
        "seed": "cpu-baked-default-seed_1",
        "checkpoint": "cpu-baked-default-ckpt_cnn_step5",
        "release": "cpu-baked-default-release_true",
        "several": "cpu-external-default-target.dtype_bfloat16",
    }
    assert api_dir.name in expected.values()


@pytest.mark.slow
def test_build_reports_progress_through_logging_and_can_be_silenced(tmp_path: Path) -> None:
    conf = module_conf(tmp_path, "mine", RAISES)
    code = (
        "import logging, sys, flashrt_build\n"
        "if sys.argv[1] == 'quiet': logging.getLogger('flashrt_build').setLevel(logging.WARNING)\n"
        f"cfg = flashrt_build.compose(['+module=mine', 'output_root={tmp_path / 'out'}'], config_dir={str(conf)!r})\n"
        "try:\n    flashrt_build.build(cfg)\nexcept flashrt_build.InstantiateError:\n    pass\n"
    )
    loud = subprocess.run([sys.executable, "-c", code, "loud"], capture_output=True, text=True, timeout=300)
    assert loud.returncode == 0, loud.stderr
    assert re.search(r"\]\[flashrt_build\]\[INFO\] - building mine <modules.RaisesInInit> for cpu/float32", loud.stderr)
    quiet = subprocess.run([sys.executable, "-c", code, "quiet"], capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 0 and "building mine" not in quiet.stderr


@pytest.mark.slow
def test_a_loaded_package_says_what_it_is(mlp_build: flashrt_build.BuildResult) -> None:
    model = flashrt_build.load(mlp_build.output_dir)
    assert repr(model) == (
        f"LoadedModule('mlp' from {str(mlp_build.output_dir)!r}, on cpu,\n  forward(x: float32[batch 1..64, 16])\n)"
    )


def test_the_package_lists_its_public_names() -> None:
    names = dir(flashrt_build)
    assert {"build", "load", "compose", "generate", "LoadedModule", "__version__"} <= set(names)
    assert not {"Any", "annotations", "importlib"} & set(names)
    assert all(hasattr(flashrt_build, name) for name in names)


def test_a_static_channel_axis_does_not_suggest_making_it_dynamic() -> None:
    from flashrt_build.runtime.call import InputCheck

    spec = {"name": "images", "dtype": "float32", "shape": [2, 3, 32, 32], "dynamic": {}, "low": None, "high": None}
    check = InputCheck([spec], torch.device("cpu"))
    with pytest.raises(ValueError) as channel:
        check({"images": torch.zeros(2, 1, 32, 32)})
    assert (
        str(channel.value) == "input 'images' has size 1 on axis 1; the package was built for 3 there (a static axis)"
    )
    with pytest.raises(ValueError, match=r"build with '\+\+module.inputs.images.dynamic=\{0: \{min: 1, max: 4\}\}'$"):
        check({"images": torch.zeros(4, 3, 32, 32)})
