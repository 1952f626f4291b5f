"""Up to date means free; any changed ingredient rebuilds and says which."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors.torch import save_file

import flashrt_build
import flashrt_build.stages.compile as compiled
from flashrt_build.config.compose import compose

pytestmark = pytest.mark.slow


def test_an_identical_build_is_a_no_op(mlp_build: flashrt_build.BuildResult) -> None:
    out = mlp_build.output_dir
    with mock.patch.object(compiled, "compile_package", wraps=compiled.compile_package) as compiler:
        again = flashrt_build.build(compose(["+module=mlp", f"output_dir={out}", f"output_root={out.parent}"]))
    assert again.status == "up_to_date" and compiler.call_count == 0
    assert again.manifest["build_key"] == mlp_build.manifest["build_key"]


def test_the_cli_no_op_imports_no_torch(mlp_build: flashrt_build.BuildResult) -> None:
    out = mlp_build.output_dir
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "flashrt_build", "+module=mlp", f"output_dir={out}",
         f"output_root={out.parent}"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0
    assert "up to date" in result.stderr and "nothing to do" in result.stderr
    imported = [line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")]
    assert "hydra" in imported and not [m for m in imported if m == "torch" or m.startswith("torch.")]


def test_a_no_op_is_answered_before_hydra_runs_and_runs_no_compiler(
    mlp_build: flashrt_build.BuildResult, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An up-to-date answer needs the config and the key: no run directory
    (Hydra's) and no compiler run (nothing is compiled); a build still probes it."""
    out = mlp_build.output_dir
    command = [sys.executable, "-m", "flashrt_build", "+module=mlp", f"output_dir={out}", f"output_root={tmp_path}"]
    noop = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert noop.returncode == 0 and "up to date" in noop.stderr, noop.stderr
    assert not (tmp_path / ".runs").exists()
    config = ["+module=mlp", f"output_dir={out}", f"output_root={out.parent}"]
    with mock.patch("flashrt_build.config.toolchain.compile_rejected", return_value="probed") as probe:
        assert flashrt_build.build(compose(config)).status == "up_to_date" and probe.call_count == 0
        with pytest.raises(flashrt_build.ConfigError, match=r"cannot compile C\+\+ \(a one-line file fails: probed\)"):
            flashrt_build.build(compose([*config, "force=true"]))
    assert flashrt_build.build(compose(config)).manifest["build_key"] == mlp_build.manifest["build_key"]


def test_each_changed_ingredient_rebuilds_and_is_named(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    package = tmp_path / "mynets"
    package.mkdir()
    (package / "__init__.py").write_text("")
    source = "import torch\n\nclass Net(torch.nn.Linear):\n    def __init__(self):\n        super().__init__(4, 2)\n"
    (package / "net.py").write_text(source)
    sys.path.insert(0, str(tmp_path))
    conf = tmp_path / "conf"
    (conf / "module").mkdir(parents=True)
    (conf / "module" / "net.yaml").write_text(
        "name: net\nmodel: {_target_: mynets.net.Net}\ninputs: {input: {shape: [2, 4]}}\n"
    )
    out = tmp_path / "out"

    def build(*overrides: str) -> flashrt_build.BuildResult:
        caplog.clear()
        cfg = compose(
            ["+module=net", f"output_dir={out}", f"output_root={tmp_path}", "verify.repeat=0", *overrides],
            config_dir=conf,
        )
        with caplog.at_level(logging.INFO, logger="flashrt_build"):
            return flashrt_build.build(cfg)

    try:
        first = build()
        assert first.status == "built" and first.manifest["key_ingredients"]["module"]["files"] == 2
        assert build().status == "up_to_date"

        (package / "net.py").write_text(source + "# a comment is a change of source\n")
        assert build().status == "built" and "changed: module" in caplog.text

        assert build("seed=7").status == "built" and "changed: weights" in caplog.text

        checkpoint = tmp_path / "net.safetensors"
        save_file({"weight": torch.ones(2, 4), "bias": torch.zeros(2)}, str(checkpoint))
        assert build("seed=7", f"module.checkpoint={checkpoint}").status == "built"
        assert "changed: weights" in caplog.text
        assert build("seed=7", f"module.checkpoint={checkpoint}").status == "up_to_date"

        assert build("seed=7", "+inductor.options.max_autotune=false").status == "built"
        assert "changed: config.inductor" in caplog.text

        forced = build("seed=7", "+inductor.options.max_autotune=false", "force=true")
        assert forced.status == "built" and "forced rebuild" in caplog.text
        assert forced.manifest["build_key"] != first.manifest["build_key"]
    finally:
        sys.path.remove(str(tmp_path))


def test_an_unverified_artifact_is_not_up_to_date_for_a_verified_build(tmp_path: Path) -> None:
    out = tmp_path / "out"
    unverified = flashrt_build.build(
        compose(["+module=mlp", f"output_dir={out}", f"output_root={tmp_path}", "verify.enabled=false"])
    )
    assert unverified.manifest["verification"]["passed"] is None
    verified = flashrt_build.build(
        compose(["+module=mlp", f"output_dir={out}", f"output_root={tmp_path}", "verify.repeat=0"])
    )
    assert verified.status == "built" and verified.manifest["verification"]["passed"] is True
    assert verified.manifest["build_key"] == unverified.manifest["build_key"]  # verification is not an ingredient


def test_an_identical_build_elsewhere_is_linked_from_the_store(mlp_build: flashrt_build.BuildResult) -> None:
    root = mlp_build.output_dir.parent
    copy = root / "copy"
    with mock.patch.object(compiled, "compile_package", wraps=compiled.compile_package) as compiler:
        result = flashrt_build.build(compose(["+module=mlp", f"output_dir={copy}", f"output_root={root}"]))
    assert result.status == "from_store" and compiler.call_count == 0
    assert (copy / "model.pt2").stat().st_ino == (mlp_build.output_dir / "model.pt2").stat().st_ino
    assert result.manifest["build_key"] == mlp_build.manifest["build_key"]
    assert result.manifest["config"]["output_dir"] == str(copy)

    # cleaning keeps what output dirs still link to; an artifact survives even a full clean
    from flashrt_build.cache.store import Store

    assert Store(root).prune()[0] == []
    assert Store(root).prune(everything=True)[0]
    model = flashrt_build.load(copy)
    assert model(x=torch.randn(2, 16)).shape == (2, 8)
    shutil.rmtree(copy)


def test_clean_command_prunes_unreferenced_entries(tmp_path: Path) -> None:
    out = tmp_path / "a"
    flashrt_build.build(
        compose(["+module=mlp", f"output_dir={out}", f"output_root={tmp_path}", "verify.enabled=false"])
    )
    assert list((tmp_path / ".store" / "artifacts").iterdir())
    shutil.rmtree(out)
    result = subprocess.run(
        [sys.executable, "-m", "flashrt_build.store", "clean", str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "1 store entries removed" in result.stdout
    assert not list((tmp_path / ".store" / "artifacts").iterdir())
