"""The C++ library (cpp/) on real packages: built once per session against the
venv's torch, then driven through flashrt-run and flashrt-api-probe in
subprocesses, its outputs compared with `flashrt_build.load` on the same inputs."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from greedy import eager_greedy
from safetensors.torch import load_file, save_file

import flashrt_build
from flashrt_build.config.compose import compose
from flashrt_build.runtime.hashing import file_record

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "build" / "cpp"


def run(*command: str | Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="session")
def cpp_tools() -> dict[str, Path]:
    """flashrt-run and flashrt-api-probe, configured and built with CMake
    against this interpreter's torch (incremental: build/cpp is kept)."""
    if shutil.which("cmake") is None:
        pytest.fail("cmake is not on PATH: the C++ library's tests need CMake 3.18+ and OpenSSL's headers")
    BUILD.parent.mkdir(parents=True, exist_ok=True)
    with open(BUILD.parent / "cpp.lock", "w") as lock:  # bench/cpp_runner.py configures the same folder
        fcntl.flock(lock, fcntl.LOCK_EX)
        configure = run(
            "cmake", "-S", REPO / "cpp", "-B", BUILD,
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
            f"-DPython3_EXECUTABLE={sys.executable}",
            "-DCMAKE_BUILD_TYPE=Release", "-DFLASHRT_BUILD_TESTS=ON",
        )  # fmt: skip
        assert configure.returncode == 0, configure.stdout[-3000:] + configure.stderr[-3000:]
        jobs = str(min(os.cpu_count() or 1, 4))
        targets = ("flashrt-run", "flashrt-generate", "flashrt-api-probe", "flashrt_test_ops")
        build = run("cmake", "--build", BUILD, "-j", jobs, "--target", *targets, timeout=900)
        assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    return {
        "run": BUILD / "flashrt-run",
        "generate": BUILD / "flashrt-generate",
        "probe": BUILD / "flashrt-api-probe",
        "ops": BUILD / "libflashrt_test_ops.so",
    }


@pytest.fixture(scope="session", params=["in_place", "threaded"])
def stateful_package(
    request: pytest.FixtureRequest,
    stateful_build: tuple[flashrt_build.BuildResult, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Path:
    """A baked package of tests/modules.Stateful (a step counter, a running mean): the one test_verify
    shares, whose package writes its state in place, and one that threads it through each call."""
    if request.param == "in_place":
        return stateful_build[0].output_dir
    out, conf = tmp_path_factory.mktemp("stateful_threaded") / "out", stateful_build[1]
    overrides = ["+module=stateful", "serve.state=threaded", f"output_dir={out}", f"output_root={out.parent}"]
    result = flashrt_build.build(compose(overrides, config_dir=conf))
    assert result.manifest["state"]["mode"] == "threaded"
    return result.output_dir


def copy_package(source: Path, tmp_path: Path) -> Path:
    """A private copy to alter: build outputs are hard links into the store."""
    target = tmp_path / "pkg"
    shutil.copytree(source, target)
    return target


def rewrite_sidecar(directory: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A new weights.safetensors whose digest the manifest records, as a build would."""
    sidecar = directory / "weights.safetensors"
    sidecar.unlink()
    save_file(tensors, str(sidecar))
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["weights"]["sha256"] = sha256(sidecar)
    manifest["weights"]["bytes"] = sidecar.stat().st_size
    (directory / "manifest.json").write_text(json.dumps(manifest))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.unlink()  # never write through a hard link
    path.write_bytes(bytes(data))


def cpp_run(tools: dict[str, Path], directory: Path, inputs: dict[str, torch.Tensor], tmp_path: Path, *extra: str):
    """flashrt-run on `inputs`; (completed process, outputs by name or None)."""
    given, out = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    save_file(inputs, str(given))
    out.unlink(missing_ok=True)
    proc = run(tools["run"], directory, "--inputs", given, "--out", out, *extra)
    return proc, (load_file(str(out)) if out.exists() else None)


def mlp_x(batch: int = 5) -> torch.Tensor:
    return torch.randn(batch, 16, generator=torch.Generator().manual_seed(batch))


def test_cpp_output_equals_python_load_on_a_baked_package(
    cpp_tools: dict[str, Path], mlp_build: flashrt_build.BuildResult, tmp_path: Path
) -> None:
    model = flashrt_build.load(mlp_build.output_dir)
    for batch in (1, 5, 64):  # the dynamic batch at its ends and between
        proc, out = cpp_run(cpp_tools, mlp_build.output_dir, {"x": mlp_x(batch)}, tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert list(out) == ["output"]
        torch.testing.assert_close(out["output"], model(mlp_x(batch)))
    assert proc.stdout.startswith("mlp on cpu: 1 call, output [64, 8] float32 -> ")


def test_cpp_output_equals_python_load_on_an_external_package(
    cpp_tools: dict[str, Path], gpt2_external_build: flashrt_build.BuildResult, tmp_path: Path
) -> None:
    ids = torch.randint(0, 1000, (2, 7), generator=torch.Generator().manual_seed(0))
    proc, out = cpp_run(cpp_tools, gpt2_external_build.output_dir, {"input_ids": ids}, tmp_path)
    assert proc.returncode == 0, proc.stderr
    # the output tree's leaf by its key; use_cache, a constant keyword argument, is no input
    assert list(out) == ["logits"] and out["logits"].shape == (2, 7, 1000)
    torch.testing.assert_close(out["logits"], flashrt_build.load(gpt2_external_build.output_dir)(ids).logits)


def test_cpp_serves_an_int8_package_as_python_does(
    cpp_tools: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """A quantized package binds plain int8 and float tensors from its sidecar: no torchao in C++."""
    out = tmp_path_factory.mktemp("mlp_int8_ext") / "out"
    built = flashrt_build.build(
        compose(["+module=mlp", "quant=int8_wo", "weights=external", f"output_dir={out}", f"output_root={out.parent}"])
    )
    assert any(t.get("quantized") and t["dtype"] == "int8" for t in built.manifest["weights"]["tensors"])
    proc, got = cpp_run(cpp_tools, out, {"x": mlp_x(5)}, tmp_path)
    assert proc.returncode == 0, proc.stderr
    torch.testing.assert_close(got["output"], flashrt_build.load(out)(mlp_x(5)))


def rechunk(directory: Path, chunk_bytes: int) -> None:
    """Record the package's and sidecar's digests in chunks of `chunk_bytes`,
    so files of a few MB take the many-chunk, many-thread path."""
    manifest = json.loads((directory / "manifest.json").read_text())
    for section in ("package", "weights"):
        manifest[section].update(file_record(directory / manifest[section]["file"], chunk_bytes))
    (directory / "manifest.json").write_text(json.dumps(manifest))


def test_a_package_recorded_in_many_chunks_opens_and_runs(
    cpp_tools: dict[str, Path], mlp_external_build: flashrt_build.BuildResult, tmp_path: Path
) -> None:
    directory = copy_package(mlp_external_build.output_dir, tmp_path)
    rechunk(directory, 64 << 10)
    manifest = json.loads((directory / "manifest.json").read_text())
    assert len(manifest["package"]["chunk_sha256"]) > 8
    # The chunks are what is checked when they match: a whole-file digest that
    # no longer agrees is not even computed (so the check runs on every core).
    manifest["package"]["sha256"] = "0" * 64
    (directory / "manifest.json").write_text(json.dumps(manifest))
    proc, out = cpp_run(cpp_tools, directory, {"x": mlp_x()}, tmp_path)
    assert proc.returncode == 0, proc.stderr
    torch.testing.assert_close(out["output"], flashrt_build.load(directory)(mlp_x()))


@pytest.mark.parametrize("chunks", ["one", "many"])
@pytest.mark.parametrize(("file", "what"), [("model.pt2", "the package"), ("weights.safetensors", "the weights")])
def test_a_flipped_byte_is_refused_naming_the_file_and_both_digests(
    cpp_tools: dict[str, Path],
    mlp_external_build: flashrt_build.BuildResult,
    tmp_path: Path,
    file: str,
    what: str,
    chunks: str,
) -> None:
    directory = copy_package(mlp_external_build.output_dir, tmp_path)
    if chunks == "many":
        rechunk(directory, 1 << 10)
    path = directory / file
    expected = sha256(path)
    flip_byte(path, path.stat().st_size // 2)
    proc, out = cpp_run(cpp_tools, directory, {"x": mlp_x()}, tmp_path)
    assert proc.returncode == 1 and out is None
    assert proc.stderr == (
        f"flashrt-run: error: {path} ({what}) was altered after its build: sha256 {sha256(path)} "
        f"differs from the manifest's {expected}; refusing to load it\n"
    )


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ("missing", "missing: fc1.weight"),
        ("reshaped", "wrong shape: fc2.weight [64, 8] (package expects [8, 64])"),
        ("retyped", "wrong dtype: norm.bias int32 (package expects float32)"),
    ],
)
def test_a_sidecar_that_does_not_fit_the_manifest_is_refused(
    cpp_tools: dict[str, Path],
    mlp_external_build: flashrt_build.BuildResult,
    tmp_path: Path,
    change: str,
    problem: str,
) -> None:
    """Its digest matches the manifest (as if built that way): the names,
    shapes and dtypes are what refuse it."""
    directory = copy_package(mlp_external_build.output_dir, tmp_path)
    tensors = load_file(str(directory / "weights.safetensors"))
    if change == "missing":
        del tensors["fc1.weight"]
    elif change == "reshaped":
        tensors["fc2.weight"] = tensors["fc2.weight"].reshape(64, 8).contiguous()
    else:
        tensors["norm.bias"] = tensors["norm.bias"].int()  # a float64 one would be cast, as any file's float is
    rewrite_sidecar(directory, tensors)
    proc, out = cpp_run(cpp_tools, directory, {"x": mlp_x()}, tmp_path)
    assert proc.returncode == 1 and out is None
    sidecar = directory / "weights.safetensors"
    assert proc.stderr == f"flashrt-run: error: weights from {sidecar} do not fit the package: {problem}\n"


def test_a_checkpoint_swapped_in_through_the_sidecar_gives_its_outputs(
    cpp_tools: dict[str, Path],
    mlp_external_build: flashrt_build.BuildResult,
    mlp_checkpoint: Path,
    tmp_path: Path,
) -> None:
    from flashrt_build.examples import MLP

    eager = MLP().eval()
    eager.load_state_dict(load_file(str(mlp_checkpoint)))
    x = mlp_x()
    with torch.no_grad():
        expected = eager(x)
    original, _ = cpp_run(cpp_tools, mlp_external_build.output_dir, {"x": x}, tmp_path)
    before = load_file(str(tmp_path / "out.safetensors"))["output"]
    assert original.returncode == 0 and not torch.allclose(before, expected)

    # A new sidecar: the checkpoint plus the forward's own constant, which it lacks.
    directory = copy_package(mlp_external_build.output_dir, tmp_path)
    constant = load_file(str(directory / "weights.safetensors"))["_tensor_constant0"]
    rewrite_sidecar(directory, {**load_file(str(mlp_checkpoint)), "_tensor_constant0": constant})
    proc, out = cpp_run(cpp_tools, directory, {"x": x}, tmp_path)
    assert proc.returncode == 0, proc.stderr
    torch.testing.assert_close(out["output"], expected)
    torch.testing.assert_close(out["output"], flashrt_build.load(directory)(x))

    # The same checkpoint given to the original package: the constant comes from its sidecar.
    proc, out = cpp_run(cpp_tools, mlp_external_build.output_dir, {"x": x}, tmp_path, "--weights", mlp_checkpoint)
    assert proc.returncode == 0, proc.stderr
    torch.testing.assert_close(out["output"], expected)


def test_a_checkpoint_that_does_not_fit_is_refused_listing_every_problem(
    cpp_tools: dict[str, Path], mlp_external_build: flashrt_build.BuildResult, tmp_path: Path
) -> None:
    gpt2_like = tmp_path / "other.safetensors"
    save_file({"fc1.weight": torch.zeros(64, 15), "lm_head.weight": torch.zeros(2, 2)}, str(gpt2_like))
    proc, out = cpp_run(cpp_tools, mlp_external_build.output_dir, {"x": mlp_x()}, tmp_path, "--weights", gpt2_like)
    assert proc.returncode == 1 and out is None
    assert proc.stderr == (
        f"flashrt-run: error: weights from {gpt2_like} do not fit the package: "
        "missing: fc1.bias, fc2.bias, fc2.weight, norm.bias, norm.weight, output_scale; unexpected: lm_head.weight; "
        "wrong shape: fc1.weight [64, 15] (package expects [64, 16])\n"
    )


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({"x": torch.zeros(5, 17)}, "input 'x' has size 17 on axis 1; the package was built for 16 "
                                    "there (a static axis)"),
        ({"x": torch.zeros(65, 16)}, "input 'x' has size 65 on axis 0 ('batch'); the package accepts 1 to 64"),
        ({"x": torch.zeros(5, 16, dtype=torch.float64)}, "input 'x' has dtype float64; the package takes float32"),
        ({"input_ids": torch.zeros(2, 3)}, "input 'input_ids' is not an input of the package; inputs: x"),
    ],
)  # fmt: skip
def test_the_runner_refuses_inputs_the_package_was_not_built_for(
    cpp_tools: dict[str, Path],
    mlp_build: flashrt_build.BuildResult,
    tmp_path: Path,
    inputs: dict[str, torch.Tensor],
    message: str,
) -> None:
    proc, out = cpp_run(cpp_tools, mlp_build.output_dir, inputs, tmp_path)
    assert (proc.returncode, proc.stderr, out) == (1, f"flashrt-run: error: {message}\n", None)


def test_the_runner_usage_errors_exit_2(cpp_tools: dict[str, Path], mlp_build: flashrt_build.BuildResult) -> None:
    proc = run(cpp_tools["run"], mlp_build.output_dir, "--out", "x.safetensors")
    assert proc.returncode == 2 and proc.stderr.startswith("flashrt-run: --inputs is required\nusage: flashrt-run DIR")
    proc = run(cpp_tools["run"], mlp_build.output_dir.parent / "nowhere", "--inputs", "a", "--out", "b")
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"flashrt-run: error: {mlp_build.output_dir.parent / 'nowhere' / 'manifest.json'} ")


def test_the_library_refuses_weights_and_inputs_like_python_load(
    cpp_tools: dict[str, Path],
    mlp_external_build: flashrt_build.BuildResult,
    mlp_checkpoint: Path,
    tmp_path: Path,
) -> None:
    given = tmp_path / "in.safetensors"
    save_file({"x": mlp_x()}, str(given))
    proc = run(cpp_tools["probe"], "errors", mlp_external_build.output_dir, given, mlp_checkpoint)
    assert proc.returncode == 0, proc.stderr
    said = dict(line.split(": ", 1) for line in proc.stdout.splitlines())

    # The same bad weights through Python's load: the same message, problem for problem.
    bad = load_file(str(mlp_checkpoint))
    del bad["fc1.weight"]
    bad.update(
        {
            "fc2.weight": torch.zeros(8, 63),
            "norm.bias": bad["norm.bias"].double(),
            "output_scale": torch.empty(8, device="meta"),
            "extra.weight": torch.zeros(2),
        }
    )
    with pytest.raises(flashrt_build.WeightsMismatch) as python:
        flashrt_build.load(mlp_external_build.output_dir, weights=bad)
    expected = str(python.value).replace("the given mapping", "the given tensors")
    assert said["bind"] == said["open with tensors"] == expected
    assert "missing: fc1.weight; unexpected: extra.weight; wrong shape: fc2.weight [8, 63]" in expected
    assert said["unchanged after refusal"] == "yes"  # a refused bind binds nothing
    strided = load_file(str(mlp_checkpoint))
    strided["fc1.weight"] = strided["fc1.weight"].t().contiguous().t()  # same shape, transposed layout
    with pytest.raises(flashrt_build.WeightsMismatch) as python:
        flashrt_build.load(mlp_external_build.output_dir, weights=strided)
    assert said["strides"] == str(python.value).replace("the given mapping", "the given tensors")
    assert "wrong strides: fc1.weight strides [1, 64] (package expects [16, 1]" in said["strides"]

    assert said == {
        **said,
        "no inputs": "the package takes 1 inputs (x), got 0",
        "undefined": "input 'x' must be a tensor, got an undefined one",
        "rank": "input 'x' has 1 dims [80]; expected 2 like [4, 16]",
        "static size": "input 'x' has size 17 on axis 1; the package was built for 16 there (a static axis)",
        "dynamic range": "input 'x' has size 0 on axis 0 ('batch'); the package accepts 1 to 64",
        "dtype": "input 'x' has dtype float16; the package takes float32",
        "device": "input 'x' is on meta; the package runs on cpu",
        "unknown name": "input 'y' is not an input of the package; inputs: x",
        "missing name": "missing inputs: x",
        "valid": "accepted",
    }


def test_the_callers_tensors_are_bound_without_a_copy(
    cpp_tools: dict[str, Path],
    mlp_external_build: flashrt_build.BuildResult,
    mlp_checkpoint: Path,
    tmp_path: Path,
) -> None:
    x = mlp_x()
    given, out = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    save_file({"x": x}, str(given))
    command = ["run", mlp_external_build.output_dir, given, out, "--map", mlp_checkpoint, "--edit", "fc2.bias"]
    proc = run(cpp_tools["probe"], *command)
    assert proc.returncode == 0, proc.stderr
    # Every tensor of the checkpoint is the caller's own; the forward's constant comes from the sidecar.
    assert proc.stdout == "borrowed: 7 of 8\n"
    result = load_file(str(out))
    weights = load_file(str(mlp_checkpoint))
    torch.testing.assert_close(result["call0.output"], flashrt_build.load(mlp_external_build.output_dir, weights)(x))
    # An in-place edit of the caller's tensor shows in the next call.
    weights["fc2.bias"] += 1
    torch.testing.assert_close(result["given.fc2.bias"], weights["fc2.bias"])
    torch.testing.assert_close(result["edited.output"], flashrt_build.load(mlp_external_build.output_dir, weights)(x))


def test_non_contiguous_inputs_are_read_in_their_own_layout(
    cpp_tools: dict[str, Path], gpt2_external_build: flashrt_build.BuildResult, tmp_path: Path
) -> None:
    """The compiled code reads its inputs row-major: a transposed, expanded or
    sliced view passed as it is gave the logits of other token ids, those its
    storage holds in that order. gpt2's ids go to a generated gather; the mlp's
    x to an extern addmm, which follows any strides, so would not show it."""
    ids = torch.randint(0, 1000, (2, 7), generator=torch.Generator().manual_seed(0))
    given, out = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    save_file({"input_ids": ids}, str(given))
    proc = run(cpp_tools["probe"], "strided", gpt2_external_build.output_dir, given, out)
    assert proc.returncode == 0, proc.stderr
    # each view the probe passed was laid out otherwise than row-major
    assert proc.stdout == "transposed: contiguous no\nexpanded: contiguous no\nsliced: contiguous no\n"
    result = load_file(str(out))
    model = flashrt_build.load(gpt2_external_build.output_dir)
    expected = {"transposed": ids, "expanded": ids[:1].expand(2, 7).contiguous(), "sliced": ids}
    for case, values in expected.items():
        torch.testing.assert_close(result[f"{case}.logits"], model(values).logits, msg=lambda m, c=case: f"{c}: {m}")


def test_a_stateful_package_threads_its_state_call_after_call(
    cpp_tools: dict[str, Path], stateful_package: Path, tmp_path: Path
) -> None:
    from modules import Stateful

    directory = stateful_package
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(3))
    given, out = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    save_file({"x": x}, str(given))
    python = flashrt_build.load(directory)
    expected = [python(x) for _ in range(3)]

    # The initial state from state.safetensors, threaded through three calls.
    proc = run(cpp_tools["probe"], "run", directory, given, out, "--calls", "3")
    assert proc.returncode == 0, proc.stderr
    result = load_file(str(out))
    for call in range(3):
        torch.testing.assert_close(result[f"call{call}.output"], expected[call])
    assert not torch.allclose(expected[0], expected[2])  # the state changes the output
    for name, value in python.state.items():
        torch.testing.assert_close(result[f"state.{name}"], value)
    assert result["state.steps"].item() == 3

    # The caller's own module, weights and state: its buffers are the state, updated in place.
    torch.manual_seed(7)
    host = Stateful().eval()
    host_file = tmp_path / "host.safetensors"
    save_file({k: v.contiguous() for k, v in host.state_dict().items()}, str(host_file))
    proc = run(cpp_tools["probe"], "run", directory, given, out, "--calls", "3", "--map", host_file)
    assert proc.returncode == 0, proc.stderr
    result = load_file(str(out))
    with torch.no_grad():
        eager = [host(x) for _ in range(3)]
    for call in range(3):
        torch.testing.assert_close(result[f"call{call}.output"], eager[call])
    torch.testing.assert_close(result["given.steps"], host.steps)
    torch.testing.assert_close(result["given.running_mean"], host.running_mean)


def test_each_method_of_a_package_is_called_from_cpp_as_from_python(
    cpp_tools: dict[str, Path], lm_build: flashrt_build.BuildResult, tmp_path: Path
) -> None:
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(1))
    token, position = torch.tensor([[7]]), torch.tensor([3])
    with torch.no_grad():  # each from a fresh load: the cache as the build left it
        prefill = flashrt_build.load(lm_build.output_dir).prefill(ids)
        decode = flashrt_build.load(lm_build.output_dir).decode(token, position)
    proc, out = cpp_run(cpp_tools, lm_build.output_dir, {"input_ids": ids}, tmp_path, "--method", "prefill")
    assert proc.returncode == 0, proc.stderr
    torch.testing.assert_close(out["output"], prefill)
    assert "tiny_lm.prefill on cpu: 1 call, output [1, 9, 256] float32" in proc.stdout
    inputs = {"input_ids": token, "position": position}
    proc, out = cpp_run(cpp_tools, lm_build.output_dir, inputs, tmp_path, "--method", "decode")
    assert proc.returncode == 0, proc.stderr
    torch.testing.assert_close(out["output"], decode)
    proc, out = cpp_run(cpp_tools, lm_build.output_dir, inputs, tmp_path, "--method", "decoder")
    assert proc.returncode == 1 and "has no method 'decoder'; its methods: prefill, decode" in proc.stderr


def test_flashrt_generate_gives_the_eager_modules_greedy_tokens(
    cpp_tools: dict[str, Path], lm_build: flashrt_build.BuildResult
) -> None:
    from flashrt_build.config.spec import resolve_spec
    from flashrt_build.stages.module import instantiate_module

    prompt = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(3))
    eager = instantiate_module(resolve_spec(compose(["+module=tiny_lm"])))
    expected = eager_greedy(eager, prompt, 40)[0].tolist()
    ids = ",".join(map(str, prompt[0].tolist()))
    # after a warm-up generation and a reset of the cache: the same tokens
    proc = run(cpp_tools["generate"], lm_build.output_dir, "--prompt", ids, "--tokens", "40", "--warmup", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    said = json.loads(proc.stdout)
    assert said["tokens"] == expected and said["prompt_length"] == 10 and said["cuda_graphs"] is False
    assert said["prefill_ms"] > 0 and said["decode_ms_per_token"] > 0 and said["tokens_per_s"] > 0
    assert flashrt_build.generate(flashrt_build.load(lm_build.output_dir), prompt, 40).tokens[0].tolist() == expected
    # a cache too short for what was asked: refused before any call, naming the limit
    proc = run(cpp_tools["generate"], lm_build.output_dir, "--prompt", ids, "--tokens", "60")
    assert proc.returncode == 1 and "positions up to 69; decode accepts position below 64" in proc.stderr
    proc = run(cpp_tools["generate"], lm_build.output_dir, "--tokens", "4")
    assert proc.returncode == 2 and "give one of --prompt and --random-prompt" in proc.stderr


def test_flashrt_generate_samples_as_python_does(
    cpp_tools: dict[str, Path], lm_build: flashrt_build.BuildResult
) -> None:
    """--temperature, --top-k, --top-p and --seed: on the CPU, the tokens
    Python's generate draws for that seed (the same operations on the same
    generator); unseeded, each run its own, the seed said to repeat one."""
    prompt = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(4))
    ids = ",".join(map(str, prompt[0].tolist()))
    sampling = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}
    flags = ["--temperature", "0.8", "--top-k", "40", "--top-p", "0.9", "--tokens", "20", "--json"]
    model = flashrt_build.load(lm_build.output_dir)
    for seed in (7, 8):
        proc = run(cpp_tools["generate"], lm_build.output_dir, "--prompt", ids, "--seed", str(seed), *flags)
        assert proc.returncode == 0, proc.stderr
        model.reset_state()
        python = flashrt_build.generate(model, prompt, 20, seed=seed, **sampling).tokens[0].tolist()
        assert json.loads(proc.stdout)["tokens"] == python and json.loads(proc.stdout)["seed"] == seed
    greedy = flashrt_build.generate(model, prompt, 20).tokens[0].tolist()
    assert python != greedy  # sampled, not the argmax
    first, second = (json.loads(run(cpp_tools["generate"], lm_build.output_dir, "--prompt", ids, *flags).stdout)
                     for _ in range(2))  # fmt: skip
    assert first["tokens"] != second["tokens"]
    again = run(cpp_tools["generate"], lm_build.output_dir, "--prompt", ids, "--seed", str(first["seed"]), *flags)
    assert json.loads(again.stdout)["tokens"] == first["tokens"]
    proc = run(cpp_tools["generate"], lm_build.output_dir, "--prompt", ids, "--tokens", "2", "--top-p", "nan")
    assert proc.returncode == 2 and "--top-p takes a number in (0, 1], not 'nan'" in proc.stderr


def test_values_outside_an_inputs_declared_range_are_refused_not_run(
    cpp_tools: dict[str, Path], gpt2_external_build: flashrt_build.BuildResult, tmp_path: Path
) -> None:
    """A token id at the vocabulary size made the package abort() the process;
    the library refuses it, as Python's load does, naming the input."""
    ids = torch.randint(0, 1000, (2, 7), generator=torch.Generator().manual_seed(0))
    ids[0, 0], ids[1, 3] = 0, 1000
    proc, out = cpp_run(cpp_tools, gpt2_external_build.output_dir, {"input_ids": ids}, tmp_path)
    assert proc.returncode == 1 and out is None
    message = "input 'input_ids' holds values from 0 to 1000; the package accepts 0 to 999 (module.inputs.input_ids"
    assert message in proc.stderr
    with pytest.raises(ValueError) as python:
        flashrt_build.load(gpt2_external_build.output_dir)(ids)
    assert str(python.value) in proc.stderr


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda m: m["weights"].update(mode="baked"), "was edited after its build: weights.mode differs"),
        (lambda m: m["inputs"][0]["dynamic"]["1"].update(max=4096), "inputs[0].dynamic.1.max differs"),
        (lambda m: m["weights"].update(mode="sideways"), "weights.mode is 'sideways', expected baked or external"),
    ],
    ids=["mode", "dynamic-max", "bogus-mode"],
)
def test_an_edited_manifest_is_refused(
    cpp_tools: dict[str, Path], gpt2_external_build: flashrt_build.BuildResult, tmp_path: Path, edit, needle: str
) -> None:
    """Editing weights.mode made the first call segfault; raising a dynamic
    max let longer inputs through. The package records what a load relies on."""
    directory = copy_package(gpt2_external_build.output_dir, tmp_path)
    manifest = json.loads((directory / "manifest.json").read_text())
    edit(manifest)
    (directory / "manifest.json").write_text(json.dumps(manifest))
    ids = torch.zeros(2, 7, dtype=torch.int64)
    proc, out = cpp_run(cpp_tools, directory, {"input_ids": ids}, tmp_path)
    assert proc.returncode == 1 and out is None and needle in proc.stderr
    with pytest.raises(flashrt_build.ArtifactError):
        flashrt_build.load(directory)


def test_flashrt_generate_serves_a_transformers_causal_lm(
    cpp_tools: dict[str, Path], llama_lm_build: tuple[flashrt_build.BuildResult, Path]
) -> None:
    """A causal_lm package (a transformers Llama from its save_pretrained
    directory): the C++ loop gives transformers' own greedy tokens."""
    from llm_families import transformers_tokens

    result, model_dir = llama_lm_build
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    expected = transformers_tokens(model_dir, prompt, 24)[0].tolist()
    ids = ",".join(map(str, prompt[0].tolist()))
    proc = run(cpp_tools["generate"], result.output_dir, "--prompt", ids, "--tokens", "24", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["tokens"] == expected


def test_a_custom_operators_library_is_loaded_before_the_package_in_python_and_cpp(
    cpp_tools: dict[str, Path], tmp_path: Path
) -> None:
    """A package calling flashrt_test_ops::scale, whose C++ kernel is in a
    library of its own: the manifest names the library, and a fresh Python
    process and flashrt-run (which never loaded it) open it first."""
    conf = tmp_path / "conf" / "module"
    conf.mkdir(parents=True)
    (conf / "scaled.yaml").write_text(
        f"name: scaled\nmodel: {{_target_: modules.CallsCppOp, library: {cpp_tools['ops']}}}\n"
        "inputs: {x: {shape: [3, 4]}}\n"
    )
    built = flashrt_build.build(
        compose(["+module=scaled", f"output_root={tmp_path / 'out'}"], config_dir=tmp_path / "conf")
    )
    assert built.manifest["libraries"] == [{"path": str(cpp_tools["ops"]), "ops": ["flashrt_test_ops::scale"]}]
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    expected = flashrt_build.load(built.output_dir)(x)
    code = (
        "import torch, flashrt_build\n"
        f"x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))\n"
        f"print(flashrt_build.load({str(built.output_dir)!r})(x).sum().item())\n"
    )
    served = run(sys.executable, "-c", code)
    assert served.returncode == 0, served.stderr[-3000:]
    assert float(served.stdout) == pytest.approx(expected.sum().item(), rel=1e-5)
    proc, out = cpp_run(cpp_tools, built.output_dir, {"x": x}, tmp_path)
    assert proc.returncode == 0, proc.stderr
    torch.testing.assert_close(out["output"], expected)


def test_a_project_of_the_users_own_finds_the_installed_library_as_the_docs_show(
    cpp_tools: dict[str, Path], mlp_build: flashrt_build.BuildResult, tmp_path: Path
) -> None:
    """docs/serving.md's whole project (its CMakeLists.txt and server.cpp, read
    from the page), against the library installed with `cmake --install`:
    configured, built and run on the mlp package, as a user would."""
    import re

    page = (REPO / "docs" / "serving.md").read_text()
    section = page[page.index("A whole project") :]
    cmake_lists, server = (body for _, body in re.findall(r"```(cmake|cpp)\n(.*?)```", section, flags=re.S)[:2])
    prefix = tmp_path / "prefix"
    installed = run("cmake", "--install", BUILD, "--prefix", prefix)
    assert installed.returncode == 0, installed.stdout[-2000:] + installed.stderr[-2000:]
    project = tmp_path / "server"
    project.mkdir()
    (project / "CMakeLists.txt").write_text(cmake_lists)
    (project / "server.cpp").write_text(server)
    configure = run(
        "cmake", "-S", project, "-B", project / "build", f"-DCMAKE_PREFIX_PATH={prefix};{torch.utils.cmake_prefix_path}"
    )  # fmt: skip
    assert configure.returncode == 0, configure.stdout[-3000:] + configure.stderr[-3000:]
    built = run("cmake", "--build", project / "build", timeout=900)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    served = run(project / "build" / "server", mlp_build.output_dir)
    assert served.returncode == 0, served.stderr[-3000:]
    expected = flashrt_build.load(mlp_build.output_dir)(torch.ones(3, 16)).sum().item()
    lines = served.stdout.splitlines()
    assert float(lines[0].removeprefix("sum ")) == pytest.approx(expected, rel=1e-5)
    assert lines[1].startswith("refused: ") and "x" in lines[1]
