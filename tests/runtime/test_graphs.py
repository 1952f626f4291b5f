"""The CUDA-graph cache's bookkeeping and the serve config, without a GPU:
the capture is a fake that records what it was asked to capture (the CUDA
calls themselves are covered by the `gpu` tests in test_serve_gpu.py)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pytest
import torch

from flashrt_build.cache.plan import make_plan
from flashrt_build.config.compose import compose
from flashrt_build.config.spec import resolve_spec
from flashrt_build.errors import ConfigError
from flashrt_build.runtime.graphs import GraphCache, Run
from flashrt_build.runtime.load import graph_options


class FakeGraph:
    """Replays by running: what a CUDA graph computes, without CUDA."""

    captured: list[list[tuple[int, ...]]] = []

    def __init__(self, run: Run, flat: Sequence[torch.Tensor], copied: Sequence[int], copy_outputs: bool) -> None:
        self.run, self.replays = run, 0
        FakeGraph.captured.append([tuple(flat[i].shape) for i in copied])

    def replay(self, flat: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        self.replays += 1
        return self.run(list(flat))


def double(flat: list[torch.Tensor]) -> list[torch.Tensor]:
    return [flat[0] * 2]


def test_a_shape_warms_up_then_captures_then_replays() -> None:
    FakeGraph.captured = []
    cache = GraphCache("decode", max_graphs=2, capture=FakeGraph)
    x = torch.ones(1, 4)
    outputs = [cache(double, [x], [0]) for _ in range(4)]
    assert all(torch.equal(out[0], x * 2) for out in outputs)
    graph = cache.graphs[((1, 4),)]
    # the first call ran plainly (the warm-up), the second captured and replayed, then replays
    assert FakeGraph.captured == [[(1, 4)]] and graph.replays == 3 and cache.uncaptured_calls == 0


def test_past_the_bound_other_shapes_run_without_a_graph_and_say_so_once(caplog: pytest.LogCaptureFixture) -> None:
    FakeGraph.captured = []
    cache = GraphCache("prefill", max_graphs=2, capture=FakeGraph)
    for length in (3, 3, 5, 5, 7, 7, 9, 3):
        out = cache(double, [torch.ones(1, length)], [0])
        assert torch.equal(out[0], torch.full((1, length), 2.0))  # every call still answers
    assert sorted(cache.graphs) == [((1, 3),), ((1, 5),)]
    assert cache.uncaptured_calls == 3  # 7, 7, 9: the bound was reached; 3 still replays
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "prefill: 2 CUDA graphs captured (serve.max_graphs" in warnings[0]
    assert "like [[1, 7]]" in warnings[0]


def test_clearing_drops_every_graph_and_warms_up_again() -> None:
    FakeGraph.captured = []
    cache = GraphCache("decode", max_graphs=1, capture=FakeGraph)
    x = torch.ones(2)
    cache(double, [x], [0]), cache(double, [x], [0])
    assert len(cache.graphs) == 1
    cache.clear()
    assert cache.graphs == {} and cache.uncaptured_calls == 0
    cache(double, [x], [0])
    assert len(FakeGraph.captured) == 1  # after a clear the first call is a warm-up again
    cache(double, [x], [0])
    assert len(FakeGraph.captured) == 2


def test_a_bound_of_zero_never_captures() -> None:
    cache = GraphCache("decode", max_graphs=0, capture=FakeGraph)
    for _ in range(3):
        cache(double, [torch.ones(2)], [0])
    assert cache.graphs == {} and cache.uncaptured_calls == 3


def test_graph_options_take_the_manifests_serve_defaults_on_cuda_only() -> None:
    manifest = {"serve": {"cuda_graphs": True, "max_graphs": 3}}
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert graph_options(manifest, cuda, None, None, True) == (3, True)
    assert graph_options(manifest, cpu, None, None, True) is None  # a CUDA default does not apply on the CPU
    assert graph_options(manifest, cuda, False, None, True) is None
    assert graph_options({}, cuda, None, None, True) is None  # manifests before `serve`: plain calls
    assert graph_options({}, cuda, True, 5, False) == (5, False)
    with pytest.raises(ValueError, match="cuda_graphs=True needs a CUDA device; this package runs on cpu"):
        graph_options(manifest, cpu, True, None, True)
    with pytest.raises(ValueError, match="max_graphs must be >= 0, got -1"):
        graph_options(manifest, cuda, True, -1, True)


def test_serve_keys_are_checked_and_keyed_where_they_matter() -> None:
    with pytest.raises(ConfigError, match="'serve.cuda_graphs' = True: CUDA graphs need a CUDA target"):
        resolve_spec(compose(["+module=tiny_lm", "serve.cuda_graphs=true"]))
    with pytest.raises(ConfigError, match="'serve.max_graphs' = -2"):
        resolve_spec(compose(["+module=tiny_lm", "target=cuda", "serve.max_graphs=-2"]))
    with pytest.raises(ConfigError, match=r"'serve.state' = 'copied': .*in_place, threaded"):
        compose(["+module=tiny_lm", "serve.state=copied"])
    base = make_plan(compose(["+module=tiny_lm", "target=cuda"])).keys
    graphs = make_plan(compose(["+module=tiny_lm", "target=cuda", "serve.cuda_graphs=true"])).keys
    threaded = make_plan(compose(["+module=tiny_lm", "target=cuda", "serve.state=threaded"])).keys
    # the loader's default is recorded (a new build) but compiles nothing new; the state mode is another program
    assert graphs["graph_key"] == base["graph_key"] and graphs["build_key"] != base["build_key"]
    assert threaded["graph_key"] != base["graph_key"]


def test_a_replayed_call_that_differs_fails_verification_naming_the_call() -> None:
    from flashrt_build.errors import VerifyError
    from flashrt_build.stages.compare import check_replayed

    spec = resolve_spec(compose(["+module=mlp"]))
    reference = torch.ones(2, 3)
    plain = {"leaves": [reference.clone()], "spec": ""}
    result = {"outputs": [plain, plain], "replayed": [plain, plain], "graphs": {"forward": 1}}
    record = check_replayed(spec, ["example", "repeat 1"], [reference, reference], result)
    assert record == {
        "passed": True,
        "calls": 2,
        "captured": {"forward": 1},
        "max_abs_err_vs_plain": 0.0,
        "max_abs_err_vs_eager": 0.0,
    }
    result["replayed"] = [plain, {"leaves": [reference + 1], "spec": ""}]
    with pytest.raises(VerifyError, match="differs from eager at repeat 1, replayed from a CUDA graph"):
        check_replayed(spec, ["example", "repeat 1"], [reference, reference], result)
