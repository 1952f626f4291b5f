"""Test tiers, in folders that follow the package's (config/, stages/,
runtime/, cache/, sweep/, commands/; test_layout.py checks its import rules).

    make test                      lint + everything, a worker per core, each file on one worker (CI runs this)
    make test-no-compile           lint + the tests not marked slow (2-3 minutes on 2 cores)
    .venv/bin/pytest -m slow        integration: real torch.export + AOTInductor builds
    .venv/bin/pytest tests/config   one folder

`slow` marks a test that compiles a package (enforced: compile_guard.py makes
AOTInductor raise in any other test and in the processes it starts) or that
takes seconds for another reason: a build command in a fresh process that
imports torch, exports a module.

Each distinct package is compiled once per run by a session-scoped fixture
below (in a folder the xdist workers share: the first compiles it, the
others find it up to date), and many tests assert on it. GPU tests are marked `gpu` and skip
without CUDA.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from compile_guard import FORBID_ENV, guard
from filelock import FileLock
from safetensors.torch import save_file

import flashrt_build
from flashrt_build.config.compose import compose

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent

# Test-only modules (tests/modules.py) must import in CLI subprocesses too.
sys.path.insert(0, str(TESTS))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item):  # noqa: ANN201 - a hook wrapper
    """A test not marked slow compiles nothing, its fixtures' setup and its
    subprocesses included (compile_guard.py)."""
    import torch._inductor

    guard(torch._inductor)
    if "slow" not in item.keywords:
        os.environ[FORBID_ENV] = item.nodeid
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item):  # noqa: ANN201 - a hook wrapper
    yield
    os.environ.pop(FORBID_ENV, None)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


def shared_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder every xdist worker of this run shares (pytest's base temp
    without one)."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"


@contextmanager
def once_per_run(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[Path]:
    """A folder of the run's shared root, held under a lock while the body
    runs: its first holder writes the files, the others find them (write
    only what is absent), and a build into it compiles once per run, the
    other workers finding it up to date."""
    folder = shared_root(tmp_path_factory) / name
    folder.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{folder}.lock"):
        yield folder


def build_config(*overrides: str, output_dir: Path) -> flashrt_build.BuildResult:
    """A real build; the output root (and its package store) is the output dir's parent."""
    return flashrt_build.build(compose([*overrides, f"output_dir={output_dir}", f"output_root={output_dir.parent}"]))


@pytest.fixture(scope="session")
def mlp_build(tmp_path_factory: pytest.TempPathFactory) -> flashrt_build.BuildResult:
    with once_per_run(tmp_path_factory, "mlp") as folder:
        return build_config("+module=mlp", output_dir=folder / "out")


@pytest.fixture(scope="session")
def mlp_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A safetensors checkpoint for mlp whose weights differ from the seeded init."""
    from flashrt_build.examples import MLP

    with once_per_run(tmp_path_factory, "ckpt") as folder:
        path = folder / "mlp.safetensors"
        if not path.exists():
            torch.manual_seed(1234)
            save_file({k: v.contiguous() for k, v in MLP().state_dict().items()}, str(path))
    return path


@pytest.fixture(scope="session")
def mlp_checkpoint_build(tmp_path_factory: pytest.TempPathFactory, mlp_checkpoint: Path) -> flashrt_build.BuildResult:
    with once_per_run(tmp_path_factory, "mlp_ckpt") as folder:
        return build_config("+module=mlp", f"module.checkpoint={mlp_checkpoint}", output_dir=folder / "out")


@pytest.fixture(scope="session")
def gpt2_build(tmp_path_factory: pytest.TempPathFactory) -> flashrt_build.BuildResult:
    with once_per_run(tmp_path_factory, "gpt2") as folder:
        return build_config("+module=gpt2_tiny", output_dir=folder / "out")


@pytest.fixture(scope="session")
def bert_build(tmp_path_factory: pytest.TempPathFactory) -> flashrt_build.BuildResult:
    with once_per_run(tmp_path_factory, "bert") as folder:
        return build_config("+module=bert_tiny", output_dir=folder / "out")


@pytest.fixture(scope="session")
def mlp_external_build(tmp_path_factory: pytest.TempPathFactory) -> flashrt_build.BuildResult:
    with once_per_run(tmp_path_factory, "mlp_ext") as folder:
        return build_config("+module=mlp", "weights=external", output_dir=folder / "out")


@pytest.fixture(scope="session")
def gpt2_external_build(tmp_path_factory: pytest.TempPathFactory) -> flashrt_build.BuildResult:
    with once_per_run(tmp_path_factory, "gpt2_ext") as folder:
        return build_config("+module=gpt2_tiny", "weights=external", output_dir=folder / "out")


@pytest.fixture(scope="session")
def stateful_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[flashrt_build.BuildResult, Path]:
    """tests/modules.Stateful (a step counter, a running mean), baked; and its config dir."""
    with once_per_run(tmp_path_factory, "stateful") as tmp:
        conf = tmp / "conf"
        if not conf.exists():
            (conf / "module").mkdir(parents=True)
            (conf / "module" / "stateful.yaml").write_text(
                "name: stateful\nmodel: {_target_: modules.Stateful}\n"
                "inputs: {x: {shape: [3, 4], dynamic: {0: {name: batch, min: 1, max: 16}}}}\n"
            )
        cfg = compose(["+module=stateful", f"output_dir={tmp / 'out'}", f"output_root={tmp}"], config_dir=conf)
        return flashrt_build.build(cfg), conf


@pytest.fixture(scope="session")
def lm_build(tmp_path_factory: pytest.TempPathFactory) -> flashrt_build.BuildResult:
    """The zoo's decoder LM as one package of two methods (prefill, decode), external weights."""
    with once_per_run(tmp_path_factory, "lm") as folder:
        return build_config("+module=tiny_lm", "weights=external", output_dir=folder / "external")


@pytest.fixture(scope="session")
def roi_align_build(tmp_path_factory: pytest.TempPathFactory) -> flashrt_build.BuildResult:
    """tests/modules.PoolsRegions: torchvision's roi_align, a custom operator with a C++ kernel."""
    tmp = tmp_path_factory.mktemp("rois")
    (tmp / "conf" / "module").mkdir(parents=True)
    (tmp / "conf" / "module" / "rois.yaml").write_text(
        "name: rois\nmodel: {_target_: modules.PoolsRegions}\n"
        "inputs: {images: {shape: [1, 3, 8, 8]}, boxes: {shape: [2, 4]}}\n"
    )
    return flashrt_build.build(compose(["+module=rois", f"output_root={tmp / 'out'}"], config_dir=tmp / "conf"))


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama saved with save_pretrained (tests/llm_families.py); tests change copies of it only."""
    from llm_families import save_family

    with once_per_run(tmp_path_factory, "saved") as folder:
        return folder / "llama" if (folder / "llama").exists() else save_family("llama", folder / "llama")


@pytest.fixture(scope="session")
def llama_lm_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[flashrt_build.BuildResult, Path]:
    """A 2-layer Llama saved with save_pretrained beside a byte-level tokenizer
    (tests/llm_families.py), built with the shipped causal_lm config,
    external weights; and its directory."""
    from llm_families import save_family, save_tokenizer

    with once_per_run(tmp_path_factory, "llama") as root:
        model_dir = root / "llama"
        if not model_dir.exists():
            save_family("llama", model_dir)
            save_tokenizer(model_dir)
        cfg = compose(["+module=causal_lm", f"module.pretrained={model_dir}", "module.max_cache_len=64",
                       "module.max_prompt=32", "weights=external", f"output_root={root / 'out'}"])  # fmt: skip
        return flashrt_build.build(cfg), model_dir


@pytest.fixture(scope="session", autouse=True)
def every_built_manifest_validates(tmp_path_factory: pytest.TempPathFactory):
    """After the session, every manifest a build wrote (each lands in its
    output root's store) validates against the shipped JSON Schema, checked by
    the jsonschema library, independently of the loader's own validator."""
    yield
    import json

    from jsonschema import Draft202012Validator

    from flashrt_build.runtime.schema import manifest_schema

    validator = Draft202012Validator(manifest_schema())
    broken = []
    roots = [Path(tmp_path_factory.getbasetemp()), shared_root(tmp_path_factory)]
    for path in sorted(p for root in roots for p in root.rglob(".store/artifacts/*/manifest.json")):
        errors = [
            f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(json.loads(path.read_text()))
        ]
        if errors:
            broken.append(f"{path}: {errors[:3]}")
    assert not broken, "manifests that break manifest.schema.json:\n" + "\n".join(broken)
