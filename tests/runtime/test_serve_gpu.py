"""Serving from CUDA graphs on a GPU (marked `gpu`: skipped without one; run
on the lent H200): tiny_lm built for CUDA with `serve.cuda_graphs`, its
verification replaying each method, generation from replayed graphs equal to
plain calls and to the eager module (float32: in bf16 the package's fused
kernels round differently from eager's and near-ties of a random model's
logits flip, which BENCHMARKS.md measures; in bf16 for a trained model, whose
tokens are decided, from Python and from C++), the graphs' bookkeeping with
real captures. The bookkeeping's logic is covered on the CPU in
test_graphs.py and test_serve.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from greedy import eager_greedy, train_on_a_cycle
from safetensors.torch import save_file

import flashrt_build
from flashrt_build.config.compose import compose
from flashrt_build.config.spec import resolve_spec
from flashrt_build.stages.module import instantiate_module

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

LM = ["+module=tiny_lm", "target=cuda", "module.model.max_len=128", "module.methods.decode.inputs.position.high=128"]


def build(tmp_path_factory: pytest.TempPathFactory, name: str, *overrides: str) -> flashrt_build.BuildResult:
    out = tmp_path_factory.mktemp(name) / "out"
    return flashrt_build.build(compose([*LM, *overrides, f"output_dir={out}", f"output_root={out.parent}"]))


@pytest.fixture(scope="module")
def lm_cuda(tmp_path_factory: pytest.TempPathFactory) -> flashrt_build.BuildResult:
    return build(tmp_path_factory, "lm_cuda", "target.dtype=float32", "weights=external", "serve.cuda_graphs=true")


@pytest.fixture(scope="module")
def lm_cuda_threaded(tmp_path_factory: pytest.TempPathFactory) -> flashrt_build.BuildResult:
    return build(tmp_path_factory, "lm_cuda_threaded", "serve.state=threaded")


def prompt(length: int = 12) -> torch.Tensor:
    return torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(length)).cuda()


def eager_tokens(new: int, ids: torch.Tensor, dtype: str, *overrides: str) -> torch.Tensor:
    module = instantiate_module(resolve_spec(compose([*LM, f"target.dtype={dtype}", *overrides])))  # as built
    return eager_greedy(module, ids, new)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    """tiny_lm trained (float32, on the GPU) until its next token is decided: a checkpoint and its rule."""
    module = instantiate_module(resolve_spec(compose([*LM, "target.dtype=float32"])))
    cycle = train_on_a_cycle(module)
    path = tmp_path_factory.mktemp("trained") / "model.safetensors"
    save_file({name: t.detach().cpu().contiguous() for name, t in module.state_dict().items()}, path)
    return path, cycle.cuda()


@pytest.fixture(scope="module")
def lm_trained(
    tmp_path_factory: pytest.TempPathFactory, trained: tuple[Path, torch.Tensor]
) -> flashrt_build.BuildResult:
    """The trained checkpoint built in bf16, external weights, serving from graphs."""
    return build(
        tmp_path_factory, "lm_trained", f"module.checkpoint={trained[0]}", "weights=external", "serve.cuda_graphs=true"
    )


def test_the_build_verifies_its_methods_replayed_from_graphs(lm_cuda: flashrt_build.BuildResult) -> None:
    manifest = lm_cuda.manifest
    graphs = manifest["verification"]["graphs"]
    assert graphs["passed"] is True and graphs["calls"] == len(manifest["verification"]["probes"])
    assert graphs["captured"]["decode"] == 1 and graphs["captured"]["prefill"] >= 1  # one per prompt length probed
    assert graphs["max_abs_err_vs_plain"] == 0.0  # the same kernels, replayed
    assert manifest["serve"] == {"cuda_graphs": True, "max_graphs": 8}


def test_generation_from_graphs_equals_plain_calls_and_eager(lm_cuda: flashrt_build.BuildResult) -> None:
    replayed = flashrt_build.load(lm_cuda.output_dir)  # serve.cuda_graphs: the build's default
    plain = flashrt_build.load(lm_cuda.output_dir, cuda_graphs=False)
    assert replayed.cuda_graphs and not plain.cuda_graphs
    tokens = flashrt_build.generate(replayed, prompt(), 64).tokens
    assert torch.equal(tokens, flashrt_build.generate(plain, prompt(), 64).tokens)
    assert torch.equal(tokens, eager_tokens(64, prompt(), "float32"))
    assert len(replayed.methods["decode"].graphs.graphs) == 1
    replayed.reset_state()  # a second prompt of that length: prefill is captured too
    assert torch.equal(flashrt_build.generate(replayed, prompt(), 64).tokens, tokens)
    assert len(replayed.methods["prefill"].graphs.graphs) == 1


def test_a_trained_model_generates_eagers_tokens_in_bf16(
    lm_trained: flashrt_build.BuildResult, trained: tuple[Path, torch.Tensor]
) -> None:
    lm = flashrt_build.load(lm_trained.output_dir)
    assert lm.cuda_graphs and lm.manifest["target"]["dtype"] == "bfloat16"
    tokens = flashrt_build.generate(lm, prompt(), 96).tokens
    cycle = trained[1]
    assert torch.equal(tokens[0, 1:], cycle[tokens[0, :-1]])  # the rule it learned: decided tokens, no near-ties
    assert torch.equal(tokens, eager_tokens(96, prompt(), "bfloat16", f"module.checkpoint={trained[0]}"))


def test_flashrt_generate_gives_the_same_tokens_from_graphs(
    lm_trained: flashrt_build.BuildResult, trained: tuple[Path, torch.Tensor]
) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from cpp_runner import build_bench_tool  # with the headers bench/cpp_runner.py --stage-deps carried here

    tool = build_bench_tool("flashrt-generate")
    ids = ",".join(map(str, prompt()[0].tolist()))
    done = subprocess.run(
        [tool, lm_trained.output_dir, "--prompt", ids, "--tokens", "96", "--cuda-graphs", "--warmup", "1", "--json"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout)
    assert said["cuda_graphs"] is True
    expected = eager_tokens(96, prompt(), "bfloat16", f"module.checkpoint={trained[0]}")
    assert said["tokens"] == expected[0].tolist()


def test_threaded_state_replays_too(lm_cuda_threaded: flashrt_build.BuildResult) -> None:
    lm = flashrt_build.load(lm_cuda_threaded.output_dir, cuda_graphs=True)
    assert lm.manifest["state"]["mode"] == "threaded" and lm.manifest["target"]["dtype"] == "bfloat16"
    tokens = flashrt_build.generate(lm, prompt(), 32).tokens
    assert torch.equal(
        tokens, flashrt_build.generate(flashrt_build.load(lm.output_dir, cuda_graphs=False), prompt(), 32).tokens
    )
    assert torch.equal(tokens, eager_tokens(32, prompt(), "bfloat16"))  # no near-tie in these 32
    assert len(lm.methods["decode"].graphs.graphs) == 1


def test_returned_outputs_are_copies_unless_asked_for_the_graphs_own(lm_cuda: flashrt_build.BuildResult) -> None:
    token, at = torch.tensor([[3]], device="cuda"), torch.tensor([0], device="cuda")
    for copy_outputs in (True, False):
        lm = flashrt_build.load(lm_cuda.output_dir, cuda_graphs=True, copy_outputs=copy_outputs)
        with torch.no_grad():
            outs = [lm.decode(token, at + i) for i in range(4)]  # warm-up, capture, replays
        kept = outs[2].clone()
        assert (outs[2].data_ptr() == outs[3].data_ptr()) is not copy_outputs
        if copy_outputs:
            assert torch.equal(outs[2], kept)  # the later replay left it alone


def test_rebinding_drops_real_graphs_and_a_reset_keeps_them(lm_cuda: flashrt_build.BuildResult) -> None:
    lm = flashrt_build.load(lm_cuda.output_dir, cuda_graphs=True)
    expected = flashrt_build.generate(lm, prompt(), 16).tokens
    lm.reset_state()
    assert torch.equal(flashrt_build.generate(lm, prompt(), 16).tokens, expected)
    assert len(lm.methods["decode"].graphs.graphs) == 1
    weights = {name: tensor.clone() for name, tensor in lm.bound_weights.items()}  # new addresses, same values
    lm.bind(weights)
    assert lm.methods["decode"].graphs.graphs == {}
    lm.reset_state()
    assert torch.equal(flashrt_build.generate(lm, prompt(), 16).tokens, expected)
    lm.bind({**weights, "head.weight": torch.zeros_like(weights["head.weight"])})
    with torch.no_grad():  # the new tensors are read: a zero head gives zero logits, replayed or not
        for i in range(3):
            assert lm.decode(torch.tensor([[1]], device="cuda"), torch.tensor([i], device="cuda")).abs().sum() == 0


def test_shapes_past_the_bound_run_without_a_graph(lm_cuda: flashrt_build.BuildResult) -> None:
    lm = flashrt_build.load(lm_cuda.output_dir, cuda_graphs=True, max_graphs=2)
    plain = flashrt_build.load(lm_cuda.output_dir, cuda_graphs=False)
    with torch.no_grad():
        for length in (5, 5, 6, 6, 7, 7, 5):
            torch.testing.assert_close(lm.prefill(prompt(length)), plain.prefill(prompt(length)), rtol=0, atol=0)
    cache = lm.methods["prefill"].graphs
    assert sorted(cache.graphs) == [((1, 5),), ((1, 6),)] and cache.uncaptured_calls == 2
