"""Verification on real packages: fresh process, probes, repeat chains, crashes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flashrt_build
from flashrt_build.config.compose import compose
from flashrt_build.config.spec import resolve_spec
from flashrt_build.stages.module import instantiate_module

pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parents[1]


def module_conf(tmp_path: Path, name: str, target: str, shape: str = "[3, 4]", dynamic: str = "{}") -> Path:
    conf = tmp_path / "conf"
    (conf / "module").mkdir(parents=True, exist_ok=True)
    (conf / "module" / f"{name}.yaml").write_text(
        f"name: {name}\nmodel: {{_target_: {target}}}\ninputs: {{x: {{shape: {shape}, dynamic: {dynamic}}}}}\n"
    )
    return conf


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flashrt_build", *args], capture_output=True, text=True, timeout=600, check=False
    )


def test_verification_runs_every_probe_in_a_fresh_process(mlp_build: flashrt_build.BuildResult) -> None:
    v = mlp_build.manifest["verification"]
    assert v["passed"] is True and v["process"] == "fresh"
    labels = [p["label"] for p in v["probes"]]
    assert labels == ["example", "batch=1", "batch=33", "batch=64", "repeat 1", "repeat 2", "repeat 3"]
    for probe in v["probes"]:
        (leaf,) = probe["outputs"]
        assert leaf["passed"] and leaf["max_abs_err"] <= leaf["atol"] or leaf["rel_err"] <= leaf["rtol"]
        assert leaf["atol"] == 1e-4 and leaf["rtol"] == 1e-4


def test_a_stateful_module_is_checked_step_by_step(
    stateful_build: tuple[flashrt_build.BuildResult, Path],
) -> None:
    result, conf = stateful_build
    m = result.manifest
    assert [t["fqn"] for t in m["state"]["tensors"]] == ["running_mean", "steps"]
    assert m["state"]["mode"] == "in_place" and m["state"]["copied_bytes_per_call"] == 0  # the package writes them
    assert (result.output_dir / "state.safetensors").is_file()
    assert {t.get("source", t["fqn"]) for t in m["weights"]["tensors"]} == {"fc.weight", "fc.bias"}
    assert [s["path"] for s in m["verification"]["state"]] == ["state.running_mean", "state.steps"]
    assert len(m["verification"]["probes"]) == 7  # 4 probes + 3 repeats, each after the one before

    reference = instantiate_module(resolve_spec(compose(["+module=stateful"], config_dir=conf)))
    model = flashrt_build.load(result.output_dir)
    for step in range(1, 6):
        x = torch.randn(2 + step, 4)
        with torch.no_grad():
            torch.testing.assert_close(model(x), reference(x), msg=f"diverged at call {step}")
        assert float(model.state["steps"]) == step
    torch.testing.assert_close(model.state["running_mean"], reference.running_mean)


def test_a_stateful_package_writes_back_into_the_hosts_buffers(
    stateful_build: tuple[flashrt_build.BuildResult, Path],
) -> None:
    result, conf = stateful_build
    host = instantiate_module(resolve_spec(compose(["+module=stateful"], config_dir=conf)))
    model = flashrt_build.load(result.output_dir, host=host)
    steps = host.steps
    model(torch.randn(3, 4))
    model(torch.randn(3, 4))
    assert host.steps is steps and float(host.steps) == 2.0  # the caller's buffer, updated in place
    assert float(host.running_mean.abs().sum()) > 0


def test_a_package_that_differs_from_eager_fails_and_publishes_nothing(tmp_path: Path) -> None:
    conf = module_conf(tmp_path, "liar", "modules.DiffersWhenExported")
    out = tmp_path / "out"
    out.mkdir()
    previous = {"schema": "flashrt_build.manifest/1", "previous": "good artifact"}
    (out / "manifest.json").write_text(json.dumps(previous))
    result = cli("--config-dir", str(conf), "+module=liar", f"output_dir={out}", f"output_root={tmp_path}")
    assert result.returncode == 1
    assert "VerifyError: package output output differs from eager at example: max_abs_err=0.5 (verify.atol 0.0001)" in (
        result.stderr
    )
    assert json.loads((out / "manifest.json").read_text()) == previous
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json"]
    # no staging and no lock file left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == [".runs", "conf", "out"]


def test_an_impossible_tolerance_fails_the_build(tmp_path: Path) -> None:
    result = cli(
        "+module=bert_tiny", "verify.atol=0", "verify.rtol=1e-300", f"output_root={tmp_path}", "verify.repeat=0"
    )
    if result.returncode == 0:
        pytest.skip("the package matched eager bit for bit: no tolerance is impossible")
    assert result.returncode == 1 and "(verify.atol 0)" in result.stderr and "verify.rtol 1e-300" in result.stderr
    assert not (tmp_path / "bert_tiny").exists()  # the folder the failed build made is gone: nothing left of it


@pytest.mark.parametrize(
    ("body", "extra", "expected"),
    [
        ("raise(SIGSEGV);", [], "LoaderCrash: the package crashed its loader process with SIGSEGV"),
        (
            "sleep(600);",
            ["verify.timeout=8"],
            "LoaderCrash: the package hung its loader process past verify.timeout=8s",
        ),
    ],
    ids=["segfault", "hang"],
)
def test_a_package_that_crashes_its_loader_fails_the_build_not_the_process(
    tmp_path: Path, body: str, extra: list[str], expected: str
) -> None:
    # A real package whose own code kills (or hangs) the process that loads it:
    # the compiler links a load-time constructor into it.
    boom = tmp_path / "boom.c"
    boom.write_text(
        f"#include <signal.h>\n#include <unistd.h>\n__attribute__((constructor)) static void boom(void) {{ {body} }}\n"
    )
    subprocess.run(["gcc", "-fPIC", "-c", str(boom), "-o", str(tmp_path / "boom.o")], check=True)
    cxx = tmp_path / "crashing-g++"
    cxx.write_text(
        f'#!/bin/sh\ncase " $* " in *" -shared "*) exec g++ "$@" {tmp_path / "boom.o"} ;; *) exec g++ "$@" ;; esac\n'
    )
    cxx.chmod(0o755)
    out = tmp_path / "out"
    result = cli("+module=mlp", f"toolchain.cxx={cxx}", f"output_dir={out}", f"output_root={tmp_path}", *extra)
    assert result.returncode == 1, result.stderr
    assert expected in result.stderr
    assert "toolchain.cxx" in result.stderr and str(cxx) in result.stderr
    assert not out.exists()


def test_toolchain_cxx_is_recorded(tmp_path: Path) -> None:
    cfg = compose(
        [
            "+module=mlp",
            "toolchain.cxx=g++",
            "verify.enabled=false",
            f"output_dir={tmp_path / 'o'}",
            f"output_root={tmp_path}",
        ]
    )
    result = flashrt_build.build(cfg)
    assert result.manifest["inductor"]["options"]["cpp.cxx"] == "g++"
    assert result.manifest["toolchain"]["cxx"]["path"].endswith("g++")
    assert result.manifest["verification"] == {"enabled": False, "passed": None}
    assert os.path.exists(result.output_dir / "model.pt2")


def test_bench_records_package_against_eager_and_torch_compile(tmp_path: Path) -> None:
    cfg = compose(
        [
            "+module=mlp",
            "verify.bench=true",
            "verify.repeat=0",
            f"output_dir={tmp_path / 'o'}",
            f"output_root={tmp_path}",
        ]
    )
    bench = flashrt_build.build(cfg).manifest["verification"]["bench"]
    assert set(bench["ms"]) == {"eager", "torch_compile", "package"}
    for timing in bench["ms"].values():
        assert 0 < timing["min"] <= timing["median"] <= timing["max"]
    assert bench["rounds"] >= 3 and bench["warmup"] >= 1 and bench["device"] == "cpu"
    assert bench["speedup"]["package_vs_eager"] == pytest.approx(
        bench["ms"]["eager"]["median"] / bench["ms"]["package"]["median"]
    )
