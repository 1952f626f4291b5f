"""Trust, second round: what a hostile or careless user tried (a user's file
with an artifact's name, code a config file smuggles past the allow-list,
weights that did not load, inputs laid out otherwise, forged files), each
refused by name with nothing of the user's lost and no code run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from clitools import cli, module_conf
from safetensors.torch import save_file

import flashrt_build
from flashrt_build.config.compose import compose
from flashrt_build.config.spec import resolve_spec
from flashrt_build.errors import ArtifactError, ConfigError
from flashrt_build.runtime.hashing import file_record

# --- data lost ----------------------------------------------------------------


@pytest.mark.slow
def test_a_users_file_with_an_artifacts_name_survives_a_rebuild(
    mlp_build: flashrt_build.BuildResult, tmp_path: Path
) -> None:
    """A baked build lists no sidecar: a weights.safetensors beside it is the user's."""
    out = tmp_path / "build"
    shutil.copytree(mlp_build.output_dir, out)
    mine = out / "weights.safetensors"
    mine.write_bytes(b"my own weights, not the build's")
    result = cli("+module=mlp", f"output_dir={out}", "seed=3", f"output_root={tmp_path / 'root'}")
    assert result.returncode == 2, result.stderr
    assert "not part of a flashrt_build artifact (weights.safetensors)" in result.stderr
    assert mine.read_bytes() == b"my own weights, not the build's"


@pytest.mark.slow
def test_a_file_the_build_did_not_write_is_judged_by_its_record(
    mlp_build: flashrt_build.BuildResult, tmp_path: Path
) -> None:
    """Resolving refuses a package of another size; publishing, the swap that
    deletes, also refuses one of the same size and other bytes."""
    from flashrt_build.cache.publish import publish

    out = tmp_path / "build"
    shutil.copytree(mlp_build.output_dir, out)
    package = out / "model.pt2"
    package.write_bytes(package.read_bytes() + b"mine")
    with pytest.raises(ConfigError, match=r"model.pt2 \(not the file its build wrote\)"):
        resolve_spec(compose(["+module=mlp", f"output_dir={out}"]), tmp_path)
    data = bytearray((mlp_build.output_dir / "model.pt2").read_bytes())
    data[-1] ^= 0xFF  # same size, other bytes
    package.write_bytes(bytes(data))
    resolve_spec(compose(["+module=mlp", f"output_dir={out}"]), tmp_path)  # by name and size it looks built
    staging = tmp_path / "staging"
    shutil.copytree(mlp_build.output_dir, staging)
    with pytest.raises(ConfigError, match=r"model.pt2 \(not the file its build wrote\)"):
        publish(staging, out)
    assert package.read_bytes() == bytes(data)
    # a build says so before any work, by digest (remembered by stat), force=true or not
    from flashrt_build.cache.plan import make_plan
    from flashrt_build.cache.reuse import decide

    for force in ("false", "true"):
        plan = make_plan(compose(["+module=mlp", f"output_dir={out}", f"output_root={tmp_path}", f"force={force}"]))
        with pytest.raises(ConfigError, match=r"model.pt2 \(not the file its build wrote\)"):
            decide(plan)
    assert package.read_bytes() == bytes(data)


def test_store_clean_removes_only_store_entries(tmp_path: Path) -> None:
    root = tmp_path / "outputs"
    packages = root / ".store" / "packages"
    (packages / "notes").mkdir(parents=True)
    (packages / "notes" / "todo.txt").write_text("mine")
    (packages / "plain.txt").write_text("mine too")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "keep.txt").write_text("keep")
    (packages / "link").symlink_to(tmp_path / "elsewhere")
    entry = packages / ("a" * 64)  # an entry the store made, which no output directory links
    entry.mkdir()
    (entry / "model.pt2").write_bytes(b"package")
    (entry / "sha256").write_text(f"{'0' * 64}  model.pt2\n")
    done = subprocess.run(
        [sys.executable, "-m", "flashrt_build.store", "clean", str(root)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert not entry.exists() and f"removed {entry}" in done.stdout
    assert (packages / "notes" / "todo.txt").read_text() == "mine"
    assert (packages / "plain.txt").read_text() == "mine too"
    assert (packages / "link").is_symlink() and (tmp_path / "elsewhere" / "keep.txt").read_text() == "keep"
    for name, why in [("notes", "no sha256 list"), ("plain.txt", "a file"), ("link", "a symbolic link")]:
        assert f"left {packages / name}: " in done.stdout and why in done.stdout
    assert "1 store entries removed" in done.stdout


def tool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=300)


def test_store_clean_names_what_is_not_the_stores_and_never_walks_a_linked_store(tmp_path: Path) -> None:
    """A folder of the user's beside `packages/` is named as left; a `.store`
    that is a link to the user's directory is not walked (its entries are not
    the store's to remove); `--all` goes before the root as well as after."""
    root = tmp_path / "outputs"
    (root / ".store" / "mine").mkdir(parents=True)
    (root / ".store" / "mine" / "notes.txt").write_text("mine")
    done = tool("flashrt_build.store", "clean", "--all", str(root))
    assert done.returncode == 0, done.stderr
    assert f"left {root / '.store' / 'mine'}: not the store's" in done.stdout
    assert (root / ".store" / "mine" / "notes.txt").read_text() == "mine"

    theirs = tmp_path / "theirs"
    entry = theirs / "packages" / ("b" * 64)  # shaped like an entry, but in a directory the store does not own
    entry.mkdir(parents=True)
    (entry / "model.pt2").write_bytes(b"mine")
    (entry / "sha256").write_text(f"{'0' * 64}  model.pt2\n")
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / ".store").symlink_to(theirs)
    done = tool("flashrt_build.store", "clean", str(linked), "--all")
    assert done.returncode == 0, done.stderr
    assert f"left {linked / '.store'}: a symbolic link to {theirs}" in done.stdout
    assert (entry / "model.pt2").read_bytes() == b"mine"


def test_examples_writes_only_into_a_new_or_empty_directory(tmp_path: Path) -> None:
    model = tmp_path / "my_model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "notes.txt").write_text("mine")
    a_file = tmp_path / "a_file"
    a_file.write_text("mine")
    for target, says in [(model, "is not empty (it holds config.json, notes.txt)"), (a_file, "is not a directory")]:
        done = tool("flashrt_build.examples", str(target))
        assert done.returncode == 2 and says in done.stderr and done.stdout == "", done.stderr
    assert (model / "config.json").read_text() == "{}" and sorted(p.name for p in model.iterdir()) == [
        "config.json",
        "notes.txt",
    ]
    assert a_file.read_text() == "mine"
    assert tool("flashrt_build.examples").returncode == 2  # no DIR: a wrong command line
    done = tool("flashrt_build.examples", str(tmp_path / "new"))
    assert done.returncode == 0 and (tmp_path / "new" / "config.json").is_file(), done.stderr


def test_a_module_name_that_escapes_leaves_no_logs_above_the_output_root(tmp_path: Path) -> None:
    root = tmp_path / "a" / "b" / "outputs"
    result = cli("+module=mlp", "module.name=../../evil", f"output_root={root}")
    assert result.returncode == 2 and "module.name" in result.stderr
    assert [p for p in tmp_path.rglob("*") if root not in (p, *p.parents) and p not in root.parents] == []


# --- code the allow-list forbids -------------------------------------------------

PAYLOAD = """
import pathlib, torch
pathlib.Path({marker!r}).write_text("ran")
class Net(torch.nn.Linear):
    def __init__(self):
        super().__init__(4, 4)
def fn(*args, **kwargs):
    pathlib.Path({marker!r}).write_text("ran")
"""
MODULE = "module:\n  name: sneaky\n  model: {_target_: flashrt_build.examples.MLP}\n  inputs: {x: {shape: [4, 16]}}\n"


@pytest.mark.parametrize(
    ("config", "extra", "key"),
    [
        (
            "allowed_targets: ['*']\nmodule:\n  name: sneaky\n  model: {_target_: payload.Net}\n"
            "  inputs: {x: {shape: [2, 4]}}\n",
            [],
            "allowed_targets",
        ),
        ("hydra:\n  callbacks:\n    x: {_target_: payload.fn}\n" + MODULE, [], "hydra.callbacks.x._target_"),
        (
            "hydra:\n  job_logging:\n    handlers:\n      evil: {'()': payload.fn}\n" + MODULE,
            [],
            "hydra.job_logging.handlers.evil.()",
        ),
        (  # the logging package's own function that evaluates a file
            "hydra:\n  job_logging:\n    handlers:\n      evil: {'()': logging.config.fileConfig}\n" + MODULE,
            [],
            "hydra.job_logging.handlers.evil.()",
        ),
        (
            "hydra:\n  job_logging:\n    handlers:\n      evil: {class: payload.fn}\n" + MODULE,
            [],
            "hydra.job_logging.handlers.evil.class",
        ),
        (
            "hydra:\n  job_logging:\n    handlers:\n      console: {stream: 'ext://payload.fn'}\n" + MODULE,
            [],
            "hydra.job_logging.handlers.console.stream",
        ),
        ("hydra:\n  job:\n    env_set: {LD_PRELOAD: /tmp/evil.so}\n" + MODULE, [], "hydra.job.env_set.LD_PRELOAD"),
        (
            "hydra:\n  launcher:\n    setup: ['python -c \"import payload\"']\n" + MODULE,
            ["-m", "hydra/launcher=slurm"],
            "hydra.launcher.setup.0",
        ),
    ],
    ids=[
        "widened-allow-list",
        "callback",
        "log-factory",
        "log-stdlib-function",
        "log-class",
        "log-ext",
        "env-set",
        "launcher-setup",
    ],  # fmt: skip
)
def test_a_config_file_cannot_run_code_the_allow_list_forbids(
    tmp_path: Path, config: str, extra: list[str], key: str
) -> None:
    marker = tmp_path / "MARKER"
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "payload.py").write_text(PAYLOAD.format(marker=str(marker)))
    conf = module_conf(tmp_path, "sneaky", "# @package _global_\n" + config)
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path / "pkg"), os.environ.get("PYTHONPATH", "")])}
    for allow in (["release=true"], ["allowed_targets=[flashrt_build.*]"]):
        flags, overrides = [a for a in extra if a.startswith("-")], [a for a in extra if not a.startswith("-")]
        result = cli(*flags, "--config-dir", str(conf), "+module=sneaky", *overrides, *allow,
                     f"output_root={tmp_path / 'out'}", env=env)  # fmt: skip
        assert result.returncode == 2, result.stderr
        # the command line's list wins over the file's, and judges its target
        refused = "module.model._target_" if key == "allowed_targets" and "release=true" not in allow else key
        assert f"'{refused}'" in result.stderr and "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert not marker.exists()
    if key == "allowed_targets":  # the API composes the same way
        with pytest.raises(ConfigError, match="set by a config file"):
            compose(["+module=sneaky", "release=true"], config_dir=conf)


def test_trust_remote_code_is_refused_under_the_allow_list(tmp_path: Path) -> None:
    """A save_pretrained directory whose config.json maps its model class to
    a file beside it: trust_remote_code would run that file."""
    marker = tmp_path / "MARKER"
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "evil.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n")
    (model_dir / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "auto_map": {"AutoModelForCausalLM": "evil.Net"}})
    )
    result = cli(
        "+module=pretrained_gpt2",
        f"module.model.pretrained_model_name_or_path={model_dir}",
        "+module.model.trust_remote_code=true",
        "release=true",
        f"output_root={tmp_path / 'out'}",
    )
    assert result.returncode == 2, result.stderr
    assert "'module.model.trust_remote_code' = True" in result.stderr and "cannot judge" in result.stderr
    assert not marker.exists()


def test_the_release_refusal_says_what_restricts_and_how_to_allow() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_spec(compose(["+module=mlp", "release=true", "module.model._target_=mymodels.cnn.SmallCNN"]))
    said = str(info.value)
    assert "a release build (release=true) admits only the shipped configs' targets" in said
    assert "allowed_targets=[mymodels.cnn.SmallCNN]" in said


# --- wrong answers in silence --------------------------------------------------


def test_from_pretrained_weights_that_do_not_load_fail_the_build(tmp_path: Path) -> None:
    """transformers loads nothing of another model's tensors and initialises
    the rest randomly; the build must not publish that as trained."""
    import transformers

    model_dir = tmp_path / "model"
    transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100)
    ).save_pretrained(model_dir)
    save_file({"encoder.weight": torch.zeros(3, 3), "encoder.bias": torch.zeros(3)}, model_dir / "model.safetensors")
    cfg = compose(
        [
            "+module=pretrained_gpt2",
            f"module.model.pretrained_model_name_or_path={model_dir}",
            "module.inputs.input_ids.high=100",
            f"output_root={tmp_path / 'out'}",
        ]
    )
    with pytest.raises(ConfigError) as info:
        flashrt_build.build(cfg)
    assert info.value.key == "module.model.pretrained_model_name_or_path"
    said = str(info.value)
    assert "missing: lm_head.weight" in said or "missing: transformer" in said
    assert "2 unexpected: encoder.bias, encoder.weight" in said
    assert not (tmp_path / "out" / "pretrained_gpt2").exists()


@pytest.mark.slow
def test_a_shard_that_also_holds_another_shards_tensor_is_refused_at_load_and_check(
    mlp_external_build: flashrt_build.BuildResult, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    out = mlp_external_build.output_dir
    weights = load_file(out / "weights.safetensors")
    shards = tmp_path / "ckpt"
    shards.mkdir()
    first = {k: v for k, v in weights.items() if k.startswith("fc1.")}
    second = {k: v for k, v in weights.items() if not k.startswith("fc1.")}
    save_file(first, shards / "model-00001-of-00002.safetensors")
    save_file({**second, "fc1.weight": weights["fc1.weight"] + 1}, shards / "model-00002-of-00002.safetensors")
    index = {k: "model-00001-of-00002.safetensors" for k in first} | {
        k: "model-00002-of-00002.safetensors" for k in second
    }
    (shards / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    with pytest.raises(ConfigError, match="shard model-00002-of-00002.safetensors does not hold what its index says"):
        flashrt_build.load(out, weights=shards)
    checked = subprocess.run(
        [sys.executable, "-m", "flashrt_build.check", str(out), str(shards)], capture_output=True, text=True
    )
    assert checked.returncode == 2 and "also holds fc1.weight" in checked.stderr, checked.stderr


def copy_with_manifest(source: Path, dest: Path, edit) -> Path:
    shutil.copytree(source, dest)
    manifest = json.loads((dest / "manifest.json").read_text())
    edit(manifest, dest)
    (dest / "manifest.json").write_text(json.dumps(manifest))
    return dest


@pytest.mark.slow
@pytest.mark.parametrize("where", ["absolute", "parent"])
def test_a_manifest_cannot_point_its_weights_outside_the_output_dir(
    mlp_external_build: flashrt_build.BuildResult, tmp_path: Path, where: str
) -> None:
    outside = tmp_path / "elsewhere.safetensors"
    shutil.copy(mlp_external_build.output_dir / "weights.safetensors", outside)
    name = str(outside) if where == "absolute" else "../elsewhere.safetensors"

    def edit(manifest: dict, dest: Path) -> None:
        manifest["weights"]["file"] = name

    out = copy_with_manifest(mlp_external_build.output_dir, tmp_path / "out", edit)
    with pytest.raises(ArtifactError, match=r"weights.file is .*expected a file name inside the output directory"):
        flashrt_build.load(out)


@pytest.mark.slow
def test_a_manifest_cannot_point_its_state_outside_the_output_dir(
    stateful_build: tuple[flashrt_build.BuildResult, Path], tmp_path: Path
) -> None:
    def edit(manifest: dict, dest: Path) -> None:
        manifest["state"]["file"] = "/etc/passwd"

    out = copy_with_manifest(stateful_build[0].output_dir, tmp_path / "out", edit)
    with pytest.raises(ArtifactError, match=r"state.file is '/etc/passwd', expected a file name inside"):
        flashrt_build.load(out)


@pytest.mark.slow
def test_a_package_that_is_not_a_zip_is_named(mlp_build: flashrt_build.BuildResult, tmp_path: Path) -> None:
    def edit(manifest: dict, dest: Path) -> None:
        (dest / "model.pt2").write_bytes(b"not a zip archive at all")
        manifest["package"].update(file_record(dest / "model.pt2"))  # the digest forged to match

    out = copy_with_manifest(mlp_build.output_dir, tmp_path / "out", edit)
    with pytest.raises(ArtifactError, match=r"model.pt2 is not an AOTInductor package: not a readable zip archive"):
        flashrt_build.load(out)


# --- wrong exit code, traceback, hang -------------------------------------------


def safetensors_file(path: Path, header: dict, data: bytes) -> Path:
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)
    return path


BAD_HEADERS = {
    "string-offsets": ({"fc1.weight": {"dtype": "F32", "shape": [1], "data_offsets": ["0", "4"]}}, 4),
    "unknown-dtype": ({"fc1.weight": {"dtype": "ZZ", "shape": [1], "data_offsets": [0, 4]}}, 4),
    "overlapping": (
        {
            "fc1.weight": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "fc1.bias": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
        },
        12,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(BAD_HEADERS))
def test_an_invalid_safetensors_header_is_one_line_everywhere(
    mlp_external_build: flashrt_build.BuildResult, tmp_path: Path, case: str
) -> None:
    header, size = BAD_HEADERS[case]
    bad = safetensors_file(tmp_path / "bad.safetensors", header, bytes(size))
    built = cli("+module=mlp", f"module.checkpoint={bad}", f"output_root={tmp_path / 'out'}")
    assert built.returncode == 2 and "is not a valid safetensors file" in built.stderr, built.stderr
    assert "instantiate" not in built.stderr and "Traceback" not in built.stderr
    checked = subprocess.run(
        [sys.executable, "-m", "flashrt_build.check", str(mlp_external_build.output_dir), str(bad)],
        capture_output=True,
        text=True,
    )
    assert checked.returncode == 2 and "not a valid safetensors file" in checked.stderr, checked.stderr
    assert "Traceback" not in checked.stderr
    with pytest.raises(ConfigError, match="not a valid safetensors file"):
        flashrt_build.load(mlp_external_build.output_dir, weights=bad)


@pytest.mark.parametrize("special", ["device", "fifo"])
def test_a_checkpoint_that_is_not_a_regular_file_is_refused_at_once(tmp_path: Path, special: str) -> None:
    path = Path("/dev/zero")
    if special == "fifo":
        path = tmp_path / "fifo"
        os.mkfifo(path)
    result = cli("+module=mlp", f"module.checkpoint={path}", f"output_root={tmp_path / 'out'}", timeout=60)
    assert result.returncode == 2, result.stderr
    expected = "is a character device" if special == "device" else "is a FIFO"
    assert f"{expected}, not a checkpoint file" in result.stderr


@pytest.mark.parametrize(("overrides", "env", "key"), [
    (["toolchain.cxx=/bin/false"], {}, "toolchain.cxx"),
    ([], {"CXX": "/bin/true"}, "CXX"),
])  # fmt: skip
def test_a_compiler_that_cannot_compile_is_refused_before_any_work(
    overrides: list[str], env: dict[str, str], key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as info:
        resolve_spec(compose(["+module=mlp", *overrides]))
    assert info.value.key == key and "cannot compile C++" in str(info.value)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["+module=mlp", "quant=int3_wo"], "config group 'quant' = 'int3_wo': no such quant config; choices: fp8,"),
        (["+module=nosuch"], "config group 'module' = 'nosuch': no such module config; choices: bert_base,"),
        (["+module=mlp", "output_dir=~"], "config key 'output_dir' = '~': Hydra's override grammar cannot read"),
    ],
    ids=["quant", "module", "tilde"],
)
def test_a_wrong_choice_or_value_is_one_line(tmp_path: Path, args: list[str], needle: str) -> None:
    result = cli(*args, f"output_root={tmp_path}")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"ConfigError: {result.stderr.strip().partition(': ')[2]}"]
    assert needle in result.stderr


def test_a_positional_input_is_matched_by_place_not_name(tmp_path: Path) -> None:
    """nn.Linear's forward takes `input`; the config may call it anything."""
    from flashrt_build.stages.domain import check_input_names

    spec = resolve_spec(compose(["+module=mlp", "module.inputs.x.positional=true"]))
    check_input_names(torch.nn.Linear(16, 8), spec, spec.methods[0])
    conf = module_conf(
        tmp_path,
        "two",
        "name: two\nmodel: {_target_: torch.nn.Linear, in_features: 16, out_features: 8}\n"
        "inputs: {a: {shape: [4, 16], positional: true}, b: {shape: [4, 16], positional: true}}\n",
    )
    two = resolve_spec(compose(["+module=two"], config_dir=conf))
    with pytest.raises(ConfigError, match=r"takes 1 positional argument\(s\) \(input\); the config passes 2"):
        check_input_names(torch.nn.Linear(16, 8), two, two.methods[0])
