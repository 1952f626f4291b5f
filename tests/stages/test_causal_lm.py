"""The LLMs people have: transformers causal LMs from their save_pretrained
directories, built with the shipped `causal_lm` config into packages of a
prefill and a decode method over a static KV cache (every family tested:
test_causal_lm_families*.py); text in and text out through the tokenizer
copied beside the package."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from llm_families import PROMPT, save_family, transformers_tokens

import flashrt_build
from flashrt_build.config.compose import compose
from flashrt_build.config.spec import resolve_spec
from flashrt_build.errors import ConfigError

pytestmark = pytest.mark.slow


def test_what_the_build_reads_and_copies(llama_lm_build: tuple[flashrt_build.BuildResult, Path]) -> None:
    result, model_dir = llama_lm_build
    manifest, out = result.manifest, result.output_dir
    copied = {f["file"]: f for f in manifest["files"]}
    assert set(copied) == {"chat_template.jinja", "generation_config.json", "tokenizer.json", "tokenizer_config.json"}
    for name, record in copied.items():
        assert (out / name).read_bytes() == (model_dir / name).read_bytes()
        assert record["sha256"] == flashrt_build.runtime.hashing.file_sha256(out / name)
    inputs = {i["file"] for i in manifest["build_inputs"] if i["key"] == "module.model.pretrained"}
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json"} <= inputs
    assert manifest["config"]["module"]["model"]["max_cache_len"] == 64  # recorded, as resolved
    # the package binds the directory's own weights: the names are the model's
    assert flashrt_build.check_checkpoint(out, model_dir) == {}
    reloaded = flashrt_build.load(out, weights=model_dir)
    assert torch.equal(flashrt_build.generate(reloaded, PROMPT, 5).tokens, transformers_tokens(model_dir, PROMPT, 5))


def generate_cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """The command in a fresh process; its output as printed (no newline translation: tokens may be a \\r)."""
    done = subprocess.run(
        [sys.executable, "-m", "flashrt_build.generate", *map(str, args)],
        capture_output=True, timeout=300, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )  # fmt: skip
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout.decode(), done.stderr.decode())


def test_text_in_text_out(llama_lm_build: tuple[flashrt_build.BuildResult, Path]) -> None:
    from transformers import AutoTokenizer

    result, model_dir = llama_lm_build
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eos = json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"]

    said = generate_cli(result.output_dir, "--prompt", "Once upon a", "--max-new-tokens", "12")
    assert said.returncode == 0, said.stderr
    prompt = torch.tensor([tokenizer.encode("Once upon a")])
    expected = transformers_tokens(model_dir, prompt, 12, eos=eos)[0].tolist()
    assert said.stdout == tokenizer.decode(expected, skip_special_tokens=True) + "\n"
    assert "prompt: 11 tokens in" in said.stderr and "ms/token" in said.stderr and "tokens/s" in said.stderr

    chat = generate_cli(result.output_dir, "--prompt", "hi", "--chat", "--max-new-tokens", "6")
    prompt = torch.tensor([tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                                         add_generation_prompt=True, return_dict=False)])  # fmt: skip
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout == tokenizer.decode(transformers_tokens(model_dir, prompt, 6, eos=eos)[0],
                                           skip_special_tokens=True) + "\n"  # fmt: skip

    ids = generate_cli(result.output_dir, "--prompt-ids", "3,1,4,1,5", "--max-new-tokens", "9")
    assert ids.returncode == 0, ids.stderr
    assert [int(t) for t in ids.stdout.strip().split(",")] == transformers_tokens(model_dir, PROMPT, 9, eos=eos)[
        0
    ].tolist()

    def sampled(seed: int | None) -> tuple[str, str]:
        sampling = ["--temperature", "1.5", "--top-k", "50", "--top-p", "0.95"]
        sampling += ["--seed", str(seed)] if seed is not None else []
        done = generate_cli(result.output_dir, "--prompt-ids", "3,1,4", "--max-new-tokens", "16", *sampling)
        assert done.returncode == 0, done.stderr
        return done.stdout, done.stderr

    assert sampled(7)[0] == sampled(7)[0] and sampled(7)[0] != sampled(8)[0]
    # unseeded, each run its own tokens (as transformers, vLLM and llama.cpp sample), the seed said to repeat one
    (first, said_first), (second, _) = sampled(None), sampled(None)
    seed = int(said_first.split("seed: ")[1].split()[0])
    assert first != second and sampled(seed)[0] == first
    too_long = generate_cli(result.output_dir, "--prompt-ids", ",".join(["1"] * 60), "--max-new-tokens", "10")
    assert too_long.returncode == 2 and "'module.max_prompt' = 32" in too_long.stderr  # the key a user sets


def test_generate_as_people_know_it(llama_lm_build: tuple[flashrt_build.BuildResult, Path], tmp_path: Path) -> None:
    """The flags of transformers' generate and llama.cpp: --json, --ignore-eos,
    --repetition-penalty (transformers' own tokens), --stop, --system,
    --prompt-file (stdin), --weights (another checkpoint, no rebuild), and a
    cache's end that stops with a note, not an error."""
    import transformers

    result, model_dir = llama_lm_build
    out = result.output_dir
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)

    def as_json(*args: str | Path, stdin: str | None = None) -> dict:
        done = subprocess.run([sys.executable, "-m", "flashrt_build.generate", out, "--json", *map(str, args)],
                              capture_output=True, text=True, timeout=300, input=stdin)  # fmt: skip
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    long = as_json("--prompt-ids", "3,1,4", "--max-new-tokens", "20", "--ignore-eos")
    assert len(long["ids"]) == 20 and long["stopped"] == "length" and long["prompt_ids"] == [3, 1, 4]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        settings = {"max_new_tokens": 12, "min_new_tokens": 12, "eos_token_id": None, "pad_token_id": 0}
        prompt = torch.tensor([[3, 1, 4]])
        penalised = model.generate(prompt, do_sample=False, repetition_penalty=1.5, **settings)[0, 3:].tolist()
    ours = as_json("--prompt-ids", "3,1,4", "--max-new-tokens", "12", "--ignore-eos", "--repetition-penalty", "1.5")
    assert ours["ids"] == penalised and ours["ids"] != long["ids"][:12]
    plain = as_json("--prompt", "Once upon a", "--max-new-tokens", "16", "--ignore-eos")
    stop = plain["text"][5:8]
    stopped = as_json("--prompt", "Once upon a", "--max-new-tokens", "16", "--ignore-eos", "--stop", stop)
    assert stopped["stopped"] == "stop" and stopped["text"] == plain["text"][: plain["text"].index(stop)]
    piped = as_json("--prompt-file", "-", "--max-new-tokens", "16", "--ignore-eos", stdin="Once upon a")
    assert piped["text"] == plain["text"]
    system = as_json("--prompt", "hi", "--chat", "--system", "be brief", "--max-new-tokens", "2")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert system["prompt_ids"] == tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                 return_dict=False)  # fmt: skip
    other = save_family("llama", tmp_path / "other", seed=2)
    swapped = as_json("--prompt-ids", "3,1,4", "--max-new-tokens", "9", "--ignore-eos", "--weights", other)
    assert swapped["ids"] == transformers_tokens(other, torch.tensor([[3, 1, 4]]), 9)[0].tolist()
    full = generate_cli(out, "--prompt-ids", "3,1,4", "--max-new-tokens", "500", "--ignore-eos")
    assert (
        full.returncode == 0
        and "stopped at the cache's end after 61 new tokens: config key 'module.max_cache_len'" in full.stderr
    )
    assert len(full.stdout.strip().split(",")) == 64 - 3


def test_text_in_text_out_from_python(llama_lm_build: tuple[flashrt_build.BuildResult, Path]) -> None:
    """`flashrt_build.generate(OUT, "text", n)`: the tokenizer beside the
    package, the model's end-of-sequence tokens, text back; token ids back
    for token ids; its files checked as the command checks them."""
    from transformers import AutoTokenizer

    result, model_dir = llama_lm_build
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eos = json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"]
    prompt = torch.tensor([tokenizer.encode("Once upon a")])
    expected = transformers_tokens(model_dir, prompt, 12, eos=eos)[0].tolist()
    text = flashrt_build.generate(result.output_dir, "Once upon a", 12)
    assert text == tokenizer.decode(expected, skip_special_tokens=True)
    loaded = flashrt_build.load(result.output_dir)
    assert flashrt_build.generate(loaded, prompt[0].tolist(), 12) == expected
    assert (
        flashrt_build.generate(loaded, prompt, 12).tokens[0].tolist()
        == transformers_tokens(model_dir, prompt, 12)[0].tolist()
    )  # a tensor: the Generation, no end-of-sequence unless given


def test_a_sweep_over_directories_gives_each_its_folder_and_reuses_the_compile(
    llama_lm_build: tuple[flashrt_build.BuildResult, Path], tmp_path: Path
) -> None:
    """The same architecture trained twice: one compile (the fixture's, in the
    same output root's store), two artifacts."""
    result, model_dir = llama_lm_build
    retrained = save_family("llama", tmp_path / "retrained", seed=1)
    root = result.output_dir.parents[1]
    sweep = subprocess.run(
        [sys.executable, "-m", "flashrt_build", "-m", "+module=causal_lm", f"module.pretrained={model_dir},{retrained}",
         "module.max_cache_len=64", "module.max_prompt=32", "weights=external", f"output_root={root}"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    folder = "cpu-external-default-module.max_cache_len_64-module.max_prompt_32"
    assert (root / model_dir.name / folder).is_dir()  # each named after its model's directory
    other = root / "retrained" / folder
    # another model in a directory of the fixture's name would land on its build: refused, naming both
    namesake = shutil.copytree(retrained, tmp_path / "elsewhere" / model_dir.name)
    sizes = ["module.max_cache_len=64", "module.max_prompt=32", "weights=external", f"output_root={root}"]
    with pytest.raises(ConfigError, match=rf"holds the build of {re.escape(str(model_dir))}, another model than"):
        resolve_spec(compose(["+module=causal_lm", f"module.pretrained={namesake}", *sizes]))
    assert "compile" not in sweep.stderr.replace("compile      skipped", "")  # each reused the fixture's package
    tokens = flashrt_build.generate(flashrt_build.load(other), PROMPT, 9).tokens
    assert tokens.tolist() == transformers_tokens(retrained, PROMPT, 9).tolist()


def test_a_quantization_recipe_applies_to_fused_projections(
    llama_lm_build: tuple[flashrt_build.BuildResult, Path],
) -> None:
    """`passes=llm quant=int8_dq_prefill`: q/k/v and gate/up fused, then
    quantized as one by their rule, prefill's activations int8 too; the
    package verifies, and `check` still sees the float checkpoint, tensor by
    tensor, as the one it was built from."""
    from flashrt_build.errors import WeightsMismatch
    from flashrt_build.runtime.checkpoint import check_checkpoint

    result, model_dir = llama_lm_build
    root = result.output_dir.parents[1]
    sizes = ["module.max_cache_len=64", "module.max_prompt=32"]
    # this test's weights are sharpened 15x, on which int8 errs more than on trained ones: a looser bound
    recipe = ["quant=int8_dq_prefill", "quant.max_rel_error=0.2", "passes=llm"]
    overrides = ["+module=causal_lm", f"module.pretrained={model_dir}", *sizes, "weights=external", *recipe]
    quantized = flashrt_build.build(compose([*overrides, f"output_root={root}"]))
    manifest = quantized.manifest
    assert manifest["verification"]["passed"] is True and manifest["quant"]["name"] == "int8_dq_prefill"
    assert quantized.output_dir.name.startswith("cpu-external-default-int8_dq_prefill-llm-module.max_cache_len_64")
    assert quantized.output_dir.parent.name == model_dir.name
    assert manifest["weights"]["bytes"] < 0.6 * result.manifest["weights"]["bytes"]
    fused = [name for name, m in manifest["quant"]["modules"].items() if "fused_from" in m]
    assert len(fused) == 2 * 2 and all(manifest["quant"]["modules"][name]["config"] != "skip" for name in fused)
    parts = [t for t in manifest["weights"]["tensors"] if t.get("quantized")]
    assert {f"{name}.weight" for name in fused} <= {t["quantized"]["from"] for t in parts if t["dtype"] == "int8"}
    assert check_checkpoint(quantized.output_dir, model_dir) == {}  # the float checkpoint, unfused and unquantized
    with pytest.raises(WeightsMismatch, match=r"quantized \(quant=int8_dq_prefill\)"):
        flashrt_build.load(quantized.output_dir, weights=model_dir)  # parts, not float weights, bind
    assert flashrt_build.generate(flashrt_build.load(quantized.output_dir), PROMPT, 9).tokens.shape == (1, 9)


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_the_cache_follows_the_module_to_another_device(family: str, tmp_path: Path) -> None:
    """A build instantiates on the CPU and moves the module to the target: the
    cache's layers make positions on their own `device`, which must follow
    (on a GPU the prefill failed with "cuda:0 and cpu")."""
    from flashrt_build.causal_lm import CausalLM

    module = CausalLM(str(save_family(family, tmp_path / family)), 16).to("meta")
    module._bind_cache()
    layers = module._cache.layers
    assert layers and all(layer.device == layer.keys.device == torch.device("meta") for layer in layers)
