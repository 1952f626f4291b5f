"""Serving an LLM from a package of two methods (prefill, decode) over a
static KV cache, on the CPU: the state written in place (the default) or
threaded through every call, greedy generation equal to the eager module's,
resetting and rebinding, and calls from several threads. The C++ side is in
test_cpp.py, the CUDA graphs themselves in test_serve_gpu.py."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
import torch.utils._pytree as pytree
from greedy import eager_greedy
from torch.overrides import TorchFunctionMode

import flashrt_build
from flashrt_build.artifact import STATE_KWARG
from flashrt_build.config.compose import compose
from flashrt_build.config.spec import resolve_spec
from flashrt_build.runtime.graphs import GraphCache, Run
from flashrt_build.runtime.load import open_package
from flashrt_build.stages.module import instantiate_module

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def lm_threaded_build(tmp_path_factory: pytest.TempPathFactory) -> flashrt_build.BuildResult:
    """tiny_lm with its cache threaded through each call (serve.state=threaded), baked."""
    out = tmp_path_factory.mktemp("lm_threaded") / "baked"
    return flashrt_build.build(
        compose(["+module=tiny_lm", "serve.state=threaded", f"output_dir={out}", f"output_root={out.parent}"])
    )


@pytest.fixture(params=["in_place", "threaded"])
def lm_package(request: pytest.FixtureRequest) -> flashrt_build.BuildResult:
    return request.getfixturevalue("lm_build" if request.param == "in_place" else "lm_threaded_build")


def eager_lm() -> torch.nn.Module:
    return instantiate_module(resolve_spec(compose(["+module=tiny_lm"])))


def prompt(length: int = 10, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(seed))


class CopyCounter(TorchFunctionMode):
    """Counts the bytes of every `Tensor.copy_` made through Python during a call."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func is torch.Tensor.copy_:
            self.bytes += args[0].nbytes
        return func(*args, **(kwargs or {}))


def call_spec_kwargs(model: flashrt_build.LoadedModule, method: str) -> set[str]:
    in_spec = pytree.treespec_loads(model.methods[method].runner.loader.get_call_spec()[0])
    _, kwargs = pytree.tree_unflatten(list(range(in_spec.num_leaves)), in_spec)
    return set(kwargs)


def test_what_prefill_writes_decode_reads_in_either_state_mode(lm_package: flashrt_build.BuildResult) -> None:
    mode = lm_package.manifest["state"]["mode"]
    lm, reference = flashrt_build.load(lm_package.output_dir), eager_lm()
    cache = lm.state["kv_cache"]
    with torch.no_grad():
        torch.testing.assert_close(lm.prefill(prompt()), reference(prompt()))
        for position in range(10, 14):
            token, at = torch.tensor([[position]]), torch.tensor([position])
            torch.testing.assert_close(lm.decode(token, at), reference.decode(token, at), msg=f"{mode} at {position}")
    assert lm.state["kv_cache"] is cache  # one cache for the package's life, in either mode
    torch.testing.assert_close(cache, reference.kv_cache)
    assert cache[:, :, :, :, :14].abs().sum() > 0 and cache[:, :, :, :, 14:].abs().sum() == 0


def test_in_place_state_is_bound_to_the_package_and_never_copied(lm_build: flashrt_build.BuildResult) -> None:
    state = lm_build.manifest["state"]
    assert state["mode"] == "in_place" and state["copied_bytes_per_call"] == 0
    assert state["state_bytes"] == eager_lm().kv_cache.nbytes
    for entry in lm_build.manifest["methods"].values():  # compiled without folding the state into constants
        assert entry["inductor_options"] == {"joint_graph_constant_folding": False}
    lm = flashrt_build.load(lm_build.output_dir)
    for method in ("prefill", "decode"):
        assert "kv_cache" in lm.constant_fqns(method)  # bound like a weight: the compiled code writes it
        assert STATE_KWARG not in call_spec_kwargs(lm, method)  # nothing passed in or returned
    counter = CopyCounter()
    with counter, torch.no_grad():
        lm.prefill(prompt())
        lm.decode(torch.tensor([[1]]), torch.tensor([10]))
    assert counter.bytes == 0
    # bound to a host module, the package writes the host's own buffer
    host, reference = eager_lm(), eager_lm()
    lm = flashrt_build.load(lm_build.output_dir, host=host)
    buffer = host.kv_cache
    with torch.no_grad():
        lm.prefill(prompt()), reference(prompt())
    assert host.kv_cache is buffer and lm.state["kv_cache"].data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(buffer, reference.kv_cache)


def test_threaded_state_is_passed_through_and_its_copy_is_recorded(
    lm_threaded_build: flashrt_build.BuildResult,
) -> None:
    state = lm_threaded_build.manifest["state"]
    assert state["mode"] == "threaded" and state["copied_bytes_per_call"] == 2 * state["state_bytes"]
    assert all(entry["inductor_options"] == {} for entry in lm_threaded_build.manifest["methods"].values())
    lm = flashrt_build.load(lm_threaded_build.output_dir)
    assert STATE_KWARG in call_spec_kwargs(lm, "decode") and "kv_cache" not in lm.constant_fqns("decode")
    counter = CopyCounter()
    with counter, torch.no_grad():
        lm.decode(torch.tensor([[1]]), torch.tensor([0]))
    assert counter.bytes == state["state_bytes"]  # written back here; the package copies it once more inside


def test_generate_equals_the_eager_modules_greedy_loop(lm_package: flashrt_build.BuildResult) -> None:
    lm = flashrt_build.load(lm_package.output_dir)
    expected = eager_greedy(eager_lm(), prompt(), 40)
    generation = flashrt_build.generate(lm, prompt(), 40, timed=True)
    assert torch.equal(generation.tokens, expected)
    assert len(set(expected[0].tolist())) > 5  # a real sequence, not one token repeated
    assert generation.prefill_s > 0 and generation.decode_s > 0 and generation.tokens_per_s > 0
    # a fresh cache gives the same tokens; the tensors stay the ones bound
    cache = lm.state["kv_cache"]
    lm.reset_state()
    assert lm.state["kv_cache"] is cache and cache.abs().sum() == 0
    assert torch.equal(flashrt_build.generate(lm, prompt(), 40).tokens, expected)


def test_sampling_at_the_edges_of_float_gives_the_likeliest_tokens(lm_build: flashrt_build.BuildResult) -> None:
    """A temperature of 1e-320 (zero in float32) or a top_p of 1e-300 is the
    greedy choice, not `inf - inf` (a RuntimeError from multinomial before);
    an eos that is not token ids is named as `eos`."""
    lm = flashrt_build.load(lm_build.output_dir)
    greedy = flashrt_build.generate(lm, prompt(), 8).tokens
    for options in ({"temperature": 1e-320}, {"temperature": 1.0, "top_p": 1e-300}):
        lm.reset_state()
        assert torch.equal(flashrt_build.generate(lm, prompt(), 8, seed=1, **options).tokens, greedy), options
    for eos in ({"a"}, "7", [1.5], True):
        with pytest.raises(ValueError, match=r"eos = .*: expected a token id or a collection of them"):
            flashrt_build.generate(lm, prompt(), 2, eos=eos)


def test_a_package_runs_on_the_threads_it_is_given_and_leaves_the_processs_setting(
    lm_build: flashrt_build.BuildResult,
) -> None:
    """`load(threads=N)`: each call runs on N CPU threads (torch's count, which
    the package's OpenMP kernels read), set around the call, put back after."""
    from flashrt_build.runtime.threads import cpu_threads, idle_cpus

    before = torch.get_num_threads()
    seen: list[int] = []
    lm = flashrt_build.load(lm_build.output_dir, threads=1)
    assert lm.threads == 1 and flashrt_build.load(lm_build.output_dir).threads is None
    with cpu_threads(3):
        seen.append(torch.get_num_threads())
    assert seen == [3] and torch.get_num_threads() == before
    assert torch.equal(flashrt_build.generate(lm, prompt(), 12).tokens, eager_greedy(eager_lm(), prompt(), 12))
    assert torch.get_num_threads() == before
    lm.threads = 2
    assert all(method.threads == 2 for method in lm.methods.values())
    with pytest.raises(ValueError, match=r"threads=0: expected a thread count >= 1"):
        flashrt_build.load(lm_build.output_dir, threads=0)
    cores = len(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match=rf"threads=100000: .* at most {4 * cores} \(4 times the {cores} core"):
        flashrt_build.load(lm_build.output_dir, threads=100000)  # a segfault before
    assert 1 <= idle_cpus() <= len(os.sched_getaffinity(0))


def test_generate_refuses_what_the_cache_cannot_hold_before_any_call(lm_build: flashrt_build.BuildResult) -> None:
    lm = flashrt_build.load(lm_build.output_dir)
    with pytest.raises(ValueError, match=r"positions up to 69; the package's decode accepts position below 64"):
        flashrt_build.generate(lm, prompt(10), 60)
    assert lm.state["kv_cache"].abs().sum() == 0
    with pytest.raises(ValueError, match=r"prompt must be \[batch, length\]"):
        flashrt_build.generate(lm, torch.tensor([1, 2]), 4)


class FakeGraph:
    """A graph that replays by running: the bookkeeping without CUDA."""

    def __init__(self, run: Run, flat: Sequence[torch.Tensor], copied: Sequence[int], copy_outputs: bool) -> None:
        self.run = run

    def replay(self, flat: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return self.run(list(flat))


def test_rebinding_drops_the_graphs_and_a_reset_keeps_them(lm_build: flashrt_build.BuildResult) -> None:
    lm = open_package(lm_build.output_dir, lm_build.manifest, graphs=(4, True))
    for name, method in lm.methods.items():
        method.graphs = GraphCache(name, 4, capture=FakeGraph)
    expected = eager_greedy(eager_lm(), prompt(), 12)
    assert torch.equal(flashrt_build.generate(lm, prompt(), 12).tokens, expected)
    decode = lm.methods["decode"].graphs
    assert len(decode.graphs) == 1 and lm.methods["prefill"].graphs.graphs == {}  # one prefill: a warm-up only
    lm.reset_state()  # in place: the graphs' addresses still hold
    assert len(decode.graphs) == 1
    assert torch.equal(flashrt_build.generate(lm, prompt(), 12).tokens, expected)
    lm.bind(lm_build.output_dir / "weights.safetensors")  # other tensors: every graph goes
    assert decode.graphs == {} and lm.methods["prefill"].graphs.graphs == {}
    lm.reset_state()
    assert torch.equal(flashrt_build.generate(lm, prompt(), 12).tokens, expected)


def test_rebinding_checks_the_weights_like_load(lm_build: flashrt_build.BuildResult, tmp_path: Path) -> None:
    lm = flashrt_build.load(lm_build.output_dir)
    weights = dict(lm.bound_weights)
    weights["head.weight"] = torch.zeros(3, 3)
    with pytest.raises(flashrt_build.WeightsMismatch, match="head.weight"):
        lm.bind(weights)
    before = flashrt_build.generate(lm, prompt(), 4).tokens
    lm.reset_state()
    assert torch.equal(flashrt_build.generate(lm, prompt(), 4).tokens, before)  # the old weights stay bound


class InFlight:
    """Stands in for a method's graphs: counts the calls running at once."""

    def __init__(self) -> None:
        self.now = self.most = 0
        self.graphs: dict = {}

    def __call__(self, run: Run, flat: list[torch.Tensor], copied: Sequence[int]) -> list[torch.Tensor]:
        self.now += 1
        self.most = max(self.most, self.now)
        time.sleep(0.002)
        try:
            return run(flat)
        finally:
            self.now -= 1

    def clear(self) -> None:
        pass


def test_calls_from_several_threads_run_one_at_a_time(lm_build: flashrt_build.BuildResult) -> None:
    lm = flashrt_build.load(lm_build.output_dir)
    seen = InFlight()
    for method in lm.methods.values():
        method.graphs = seen
    errors: list[BaseException] = []

    def caller(seed: int) -> None:
        try:
            with torch.no_grad():
                for step in range(5):
                    lm.decode(torch.tensor([[seed]]), torch.tensor([step]))
                    lm.prefill(prompt(4, seed))
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=caller, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == [] and seen.most == 1 and seen.now == 0


def test_decode_steps_from_generate_skip_only_the_value_check(lm_build: flashrt_build.BuildResult) -> None:
    """A serving loop's tokens are argmaxes over the logits and its positions
    are counted: checking their values would wait for the device every step."""
    lm = flashrt_build.load(lm_build.output_dir)
    token, at = torch.tensor([[5]]), torch.tensor([3])
    with torch.no_grad():
        torch.testing.assert_close(lm.decode.run_trusted(token, at), lm.decode(token, at))
        with pytest.raises(ValueError, match="input 'input_ids' has 3 dims"):
            lm.decode.run_trusted(torch.tensor([[[5]]]), at)  # shapes are still checked
        with pytest.raises(ValueError, match="holds values from 256 to 256"):
            lm.decode(torch.tensor([[256]]), at)
    decode, trusted = lm.methods["decode"], []
    checked = decode.run_trusted
    decode.run_trusted = lambda *args, **kwargs: (trusted.append(1), checked(*args, **kwargs))[1]
    lm.reset_state()
    assert torch.equal(flashrt_build.generate(lm, prompt(), 9).tokens, eager_greedy(eager_lm(), prompt(), 9))
    assert len(trusted) == 8
    # a decode whose declared range is narrower than the logits: every step goes through the checked call
    lm.manifest["methods"]["decode"]["inputs"][0]["high"] = 3
    lm.reset_state()
    assert torch.equal(flashrt_build.generate(lm, prompt(), 9).tokens, eager_greedy(eager_lm(), prompt(), 9))
    assert len(trusted) == 8


# --- a fused package (`passes=llm`) given a checkpoint that lacks a part ------------------------

FUSED = "layers.0.attn.q_proj__k_proj__v_proj.weight"
PARTS = [f"layers.0.attn.{p}_proj.weight" for p in "qkv"]


def fused_manifest() -> dict:
    """What a `passes=llm` build records of one fused q/k/v projection (4 rows each of width 8), and an o_proj."""
    tensors = [
        {"fqn": FUSED, "shape": [12, 8], "dtype": "float32", "kind": "parameter"},
        {"fqn": "layers.0.attn.o_proj.weight", "shape": [8, 8], "dtype": "float32", "kind": "parameter"},
    ]
    fused = [{"weight": FUSED, "from": [{"name": part, "rows": [4 * i, 4 * i + 4]} for i, part in enumerate(PARTS)]}]
    return {"weights": {"mode": "external", "tensors": tensors}, "passes": {"fuse_projections": {"fused": fused}}}


def test_a_part_missing_from_a_fused_tensor_is_named_not_the_fused_tensor() -> None:
    """Was "missing: ...q_proj__k_proj__v_proj.weight; unexpected: ...q_proj.weight, ...v_proj.weight"."""
    from flashrt_build.errors import WeightsMismatch
    from flashrt_build.runtime.binding import weights_to_bind
    from flashrt_build.runtime.checkpoint import compare, unfused_view

    manifest = fused_manifest()
    full = {name: torch.randn(4, 8) for name in PARTS} | {"layers.0.attn.o_proj.weight": torch.randn(8, 8)}
    bound = weights_to_bind(manifest, full, None, None, torch.device("cpu"))  # every part: fused at load
    assert torch.equal(bound[FUSED], torch.cat([full[name] for name in PARTS]))

    lacking = {k: v for k, v in full.items() if k != PARTS[1]}  # no k_proj
    with pytest.raises(WeightsMismatch) as info:
        weights_to_bind(manifest, lacking, None, None, torch.device("cpu"))
    assert info.value.problems == {"missing": [PARTS[1]]}
    assert str(info.value) == f"weights from the given mapping do not fit the package: missing: {PARTS[1]}"

    # `check`'s view of a checkpoint file: the same names
    table = {name: ([4, 8], "float32") for name in PARTS if name != PARTS[1]}
    table["layers.0.attn.o_proj.weight"] = ([8, 8], "float32")
    entries = unfused_view(manifest["weights"]["tensors"], manifest, table)
    assert compare(entries, table)[1] == {"missing": [PARTS[1]]}
    # a checkpoint naming the fused tensor itself is compared as the package binds it
    assert (
        unfused_view(manifest["weights"]["tensors"], manifest, {FUSED: ([12, 8], "float32")})
        == manifest["weights"]["tensors"]
    )
