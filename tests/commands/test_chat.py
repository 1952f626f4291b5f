"""A conversation over one package (`generate --interactive`): the KV cache
kept between turns, each turn's tokens past what the cache holds decoded
from there, the answer the same as a fresh generation of the whole
conversation."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from clitools import QUIET, REPO

import flashrt_build
from flashrt_build.runtime.generate import generate_ids

pytestmark = pytest.mark.slow

LlamaBuild = tuple[flashrt_build.BuildResult, Path]


def generate_cli(out: Path, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flashrt_build.generate", str(out), *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, **QUIET, "TOKENIZERS_PARALLELISM": "false"},
    )


def test_a_turn_decoded_from_the_cache_is_a_fresh_generation_of_the_whole(llama_lm_build: LlamaBuild) -> None:
    model = flashrt_build.load(llama_lm_build[0].output_dir)
    conversation = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(5))
    generate_ids(model, conversation[:, :12], 5)  # the first turn: its prompt and reply in the cache
    assert any(bool(t.abs().sum() > 0) for t in model.state.values())
    continued = generate_ids(model, conversation, 8, cached=12)  # 8 of the 20 decoded from position 12
    model.reset_state()
    fresh = generate_ids(model, conversation, 8)
    assert torch.equal(continued.tokens, fresh.tokens)
    with pytest.raises(ValueError, match=r"cached = 20: expected 0 <= cached < the prompt's 20 tokens"):
        generate_ids(model, conversation, 2, cached=20)


def test_an_interactive_conversation_keeps_the_cache_and_starts_over_on_reset(llama_lm_build: LlamaBuild) -> None:
    out = llama_lm_build[0].output_dir
    flags = ["--chat", "--max-new-tokens", "4", "--ignore-eos"]
    alone = generate_cli(out, "--prompt", "hi", *flags)
    assert alone.returncode == 0, alone.stderr
    first = alone.stdout.removesuffix("\n")
    done = generate_cli(out, "--interactive", *flags, stdin="hi\nthere\n\n/reset\nhi\n")
    assert done.returncode == 0, done.stderr
    reports = [line for line in done.stderr.splitlines() if line.startswith("[")]
    assert len(reports) == 3, done.stderr  # the empty line is no turn
    assert reports[0].startswith("[5 prompt tokens, prefilled")  # "<hi>:" in a byte-level vocabulary
    assert "of them cached" in reports[1] and not reports[1].startswith("[0 ")
    assert "(the conversation starts over)" in done.stderr
    assert done.stdout.startswith(first + "\n") and done.stdout.endswith("\n" + first + "\n")  # greedy: as alone


def test_a_conversation_that_outgrows_the_cache_says_so_and_keeps_listening(llama_lm_build: LlamaBuild) -> None:
    long_turn = "x" * 40  # the package's cache holds 64 positions
    done = generate_cli(
        llama_lm_build[0].output_dir, "--interactive", "--max-new-tokens", "20", "--ignore-eos",
        stdin=f"{'y' * 20}\n{long_turn}\n/reset\nab\n",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "the conversation no longer fits: " in done.stderr and "/reset starts over" in done.stderr
    assert done.stderr.count("prompt tokens") == 2  # the first turn and the one after /reset
    assert generate_cli(llama_lm_build[0].output_dir, "--interactive", "--json").returncode == 2


def test_text_that_is_not_text_is_refused_by_name_and_a_conversation_goes_on(llama_lm_build: LlamaBuild) -> None:
    out = llama_lm_build[0].output_dir
    done = subprocess.run(
        [sys.executable, "-m", "flashrt_build.generate", str(out), "--interactive", "--max-new-tokens", "2"],
        input=b"hello\xff\xfe world\n" + b"x" * (65 << 20) + b"\nab\n", capture_output=True, timeout=300, cwd=REPO,
        env={**os.environ, **QUIET},
    )  # fmt: skip
    stderr = done.stderr.decode()
    assert done.returncode == 0 and "that line is not UTF-8 text, so it was not said" in stderr, stderr
    assert "that line is longer than 64 MiB, more text than any package's prompt takes" in stderr  # never held whole
    assert stderr.count("prompt tokens") == 1  # the last line was a turn
    with pytest.raises(ValueError, match=r"prompt: not text: '\\ud800' \(character 2\) is a lone surrogate"):
        flashrt_build.generate(out, "hi\ud800", 2)
    with pytest.raises(TypeError, match=r"model: expected an output directory or a loaded package .* got NoneType"):
        flashrt_build.generate(None, "hi", 2)


def test_a_sampled_conversation_says_its_seed_and_the_seed_repeats_it(llama_lm_build: LlamaBuild) -> None:
    out, turns = llama_lm_build[0].output_dir, "hi\nab\n"
    flags = ["--interactive", "--temperature", "1", "--max-new-tokens", "6"]
    first = generate_cli(out, *flags, stdin=turns)
    said = [line for line in first.stderr.splitlines() if line.startswith("seed: ")]
    assert first.returncode == 0 and len(said) == 1, first.stderr  # once, for the whole conversation
    seed = said[0].split()[1]
    again = generate_cli(out, *flags, "--seed", seed, stdin=turns)
    assert again.returncode == 0 and again.stdout == first.stdout and "seed: " not in again.stderr
