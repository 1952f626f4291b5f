"""The surfaces added since the core hold the core's promises (issue 54):
`python -m flashrt_build.generate` (G) and `flashrt_build.generate`.

- The files served beside a package (a tokenizer, generation_config.json)
  are checked like the weights: against the manifest's digests, by `load`
  and G, and refused at the build when they are no JSON; published files
  are read-only hard links into the store.
- G fails the way the build command does: one line on stderr, the README's
  exit codes, no traceback; a chat template renders under bounds.
- A prompt the package was not built for is named by the key a user sets
  (`module.max_prompt`, `module.max_cache_len`, `module.batch`).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from clitools import QUIET, REPO, cli

import flashrt_build
from flashrt_build.cache.publish import publish
from flashrt_build.cache.store import Store
from flashrt_build.config.compose import compose
from flashrt_build.errors import ArtifactError
from flashrt_build.runtime.generate import PromptRefused
from flashrt_build.runtime.hashing import file_sha256

LlamaBuild = tuple[flashrt_build.BuildResult, Path]
G = [sys.executable, "-m", "flashrt_build.generate"]


def generate_cli(
    *args: str | bytes | Path, env: dict[str, str] | None = None, input_text: str | None = None
) -> subprocess.CompletedProcess[str]:
    """G in a fresh process, as users see it (no traceback asked for)."""
    done = subprocess.run(
        [*G, *(a if isinstance(a, bytes) else str(a) for a in args)],
        input=None if input_text is None else input_text.encode(),
        capture_output=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, **QUIET, "TOKENIZERS_PARALLELISM": "false", **(env or {})},
    )
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout.decode(), done.stderr.decode())


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    """The failure's one line on stderr, and nothing else there."""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


def copy_build(out: Path, to: Path) -> Path:
    """A copy of a build (files, not links into the store), writable."""
    shutil.copytree(out, to)
    for path in to.iterdir():
        path.chmod(0o644)
    return to


# --- served files are checked like weights ----------------------------------------


def test_a_served_json_file_that_does_not_parse_fails_the_build(tmp_path: Path) -> None:
    broken = tmp_path / "tokenizer.json"
    broken.write_text('{"version": ')
    done = cli("+module=mlp", f"+module.files=[{broken}]", f"output_root={tmp_path / 'out'}")
    assert done.returncode == 2, done.stderr
    assert "config key 'module.files.0'" in done.stderr and str(broken) in done.stderr
    assert "tokenizer.json does not parse as JSON" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out" / "mlp").exists()  # refused before anything was built


@pytest.mark.parametrize(
    ("name", "content", "says"),
    [
        ("generation_config.json", '{"eos_token_id": "abc"}', "its eos_token_id = 'abc': expected a token id"),
        ("generation_config.json", "[1, 2]", "generation_config.json holds a list, not a JSON object"),
        ("tokenizer_config.json", '{"auto_map": {"AutoTokenizer": ["t.Tok", null]}}', "tokenizer code of its own"),
        ("generation_config.json", '{"eos_token_id": 99999999999999999999999}', "(integers from 0 to 2**63 - 1)"),
        ("tokenizer.json", '{"version": "1.0", "model": null}', "is not a tokenizer the tokenizers library reads"),
        ("chat_template.jinja", b"<\xff\xfe>", "chat_template.jinja is not UTF-8 text (byte 1)"),
    ],
)
def test_a_served_file_generate_would_fail_on_is_refused_at_the_build(
    name: str, content: str | bytes, says: str, tmp_path: Path
) -> None:
    served = tmp_path / name
    served.write_bytes(content if isinstance(content, bytes) else content.encode())
    done = cli("+module=mlp", f"+module.files=[{served}]", f"output_root={tmp_path / 'out'}")
    assert done.returncode == 2, done.stderr
    assert "config key 'module.files.0'" in done.stderr and says in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out" / "mlp").exists()


@pytest.mark.slow
def test_an_edited_served_file_is_refused_by_load_and_generate(llama_lm_build: LlamaBuild, tmp_path: Path) -> None:
    result, _ = llama_lm_build
    out = copy_build(result.output_dir, tmp_path / "out")
    recorded = {r["file"]: r["sha256"] for r in result.manifest["files"]}
    tokenizer = out / "tokenizer.json"
    text = tokenizer.read_text()
    assert '"a": 64' in text and '"b": 65' in text
    # the same size, valid JSON, other ids for "a" and "b": before the check, another prompt and exit 0
    tokenizer.write_text(text.replace('"a": 64', '"a": @@').replace('"b": 65', '"b": 64').replace('"a": @@', '"a": 65'))
    assert tokenizer.stat().st_size == len(text.encode()) and file_sha256(tokenizer) != recorded["tokenizer.json"]

    done = generate_cli(out, "--prompt", "ab", "--max-new-tokens", "4")
    assert done.returncode == 1 and done.stdout == ""
    line = one_line(done)
    assert str(tokenizer) in line and "altered after its build" in line
    assert file_sha256(tokenizer) in line and recorded["tokenizer.json"] in line  # what was found, what was recorded
    with pytest.raises(
        ArtifactError,
        match=rf"{re.escape(str(tokenizer))}.*sha256 {file_sha256(tokenizer)} .* {recorded['tokenizer.json']}",
    ):
        flashrt_build.load(out)
    # --prompt-ids reads no tokenizer, but the package's own files are still checked
    assert generate_cli(out, "--prompt-ids", "1,2", "--max-new-tokens", "2").returncode == 1

    shutil.copyfile(result.output_dir / "tokenizer.json", tokenizer)
    config = out / "generation_config.json"
    config.write_text(config.read_text().replace('"eos_token_id": 2', '"eos_token_id": 9'))  # stops elsewhere
    with pytest.raises(ArtifactError, match=r"generation_config.json \(a file served beside the package\) was altered"):
        flashrt_build.load(out)
    assert "generation_config.json" in one_line(generate_cli(out, "--prompt-ids", "1,2", "--max-new-tokens", "2"))


@pytest.mark.slow
def test_a_tokenizer_file_the_build_did_not_write_is_refused(llama_lm_build: LlamaBuild, tmp_path: Path) -> None:
    """transformers reads special_tokens_map.json or added_tokens.json when they are there: one that
    appeared beside the package changes the ids as an edit would."""
    result, _ = llama_lm_build
    out = copy_build(result.output_dir, tmp_path / "out")
    (out / "added_tokens.json").write_text('{"<x>": 300}')
    done = generate_cli(out, "--prompt", "ab", "--max-new-tokens", "2")
    assert done.returncode == 1
    assert f"{out} holds entries its build did not write" in one_line(done) and "added_tokens.json" in one_line(done)


@pytest.mark.slow
def test_published_files_are_read_only_links_into_the_store(llama_lm_build: LlamaBuild) -> None:
    result, _ = llama_lm_build
    out = result.output_dir
    entry = out.parents[1] / ".store" / "artifacts" / result.manifest["build_key"]
    for path in sorted(out.iterdir()):
        stored = entry / path.name
        assert stat.S_IMODE(path.stat().st_mode) & 0o222 == 0, path  # no write bit, for anyone
        assert path.stat().st_ino == stored.stat().st_ino, path  # the store's file itself
    assert {r["file"] for r in result.manifest["files"]} <= {p.name for p in entry.iterdir()}
    assert stat.S_IMODE((entry / "sha256").stat().st_mode) & 0o222 == 0


def test_read_only_artifacts_are_still_replaced_and_pruned(tmp_path: Path) -> None:
    """Published and stored files lose their write bits; a rebuild still
    swaps the directory and `store clean` still unlinks the entry (both need
    only the directories' write bits)."""
    out = tmp_path / "out"

    def staged(text: str) -> Path:
        staging = tmp_path / f"staging-{text}"
        staging.mkdir()
        (staging / "model.pt2").write_text(text)
        (staging / "manifest.json").write_text(
            '{"schema": "flashrt_build.manifest/1", "package": {"file": "model.pt2"}}'
        )
        return staging

    publish(staged("one"), out)
    assert [stat.S_IMODE(p.stat().st_mode) & 0o222 for p in sorted(out.iterdir())] == [0, 0]
    assert stat.S_IMODE(out.stat().st_mode) & 0o200  # the folder stays the owner's to replace
    publish(staged("two"), out)
    assert (out / "model.pt2").read_text() == "two" and not list(tmp_path.glob("staging-*"))

    store = Store(tmp_path)
    store.put("artifacts", "key", [out / "model.pt2"])
    entry = tmp_path / ".store" / "artifacts" / "key"
    assert (entry / "model.pt2").stat().st_ino == (out / "model.pt2").stat().st_ino
    assert stat.S_IMODE((entry / "sha256").stat().st_mode) & 0o222 == 0
    assert store.prune() == ([], [])  # still linked from the output directory
    (out / "model.pt2").unlink()
    assert store.prune() == ([entry], []) and not entry.exists()


# --- G under the build's error framework ----------------------------------------------

FLAGS = [
    ("--temperature", "nan"),
    ("--temperature", "inf"),
    ("--temperature", "-1"),
    ("--top-p", "0"),
    ("--top-p", "1.5"),
    ("--top-p", "nan"),
    ("--top-k", "0"),
    ("--max-new-tokens", "0"),
    ("--threads", "0"),
    ("--threads", "100000"),  # a segfault before: past the cores every thread only waits
    ("--seed", "18446744073709551616"),  # 2**64: torch's "Overflow when unpacking long long" before
    ("--seed", "9223372036854775808"),
    ("--seed", "-1"),
    ("--prompt-ids", "1,,2"),  # the empty item was dropped: the prompt [1, 2]
    ("--prompt-ids", "1,2,"),
    ("--prompt-ids", "1,x"),
]


@pytest.mark.parametrize(("flag", "value"), FLAGS)
def test_a_flag_out_of_range_is_named_before_anything_is_read(flag: str, value: str, tmp_path: Path) -> None:
    done = generate_cli(tmp_path / "nothing", "--prompt-ids", "1,2", flag, value)
    assert done.returncode == 2
    assert one_line(done).startswith(f"ConfigError: argument '{flag}' = ")


def test_a_failure_shows_its_traceback_when_asked(tmp_path: Path) -> None:
    done = generate_cli(
        tmp_path / "nothing", "--prompt-ids", "1", "--temperature", "nan", env={"FLASHRT_TRACEBACK": "1"}
    )
    assert done.returncode == 2 and "Traceback" in done.stderr
    assert done.stderr.splitlines()[-1].startswith("ConfigError: argument '--temperature' = nan")


def test_a_directory_without_a_build_is_a_wrong_command_line(tmp_path: Path) -> None:
    done = generate_cli(tmp_path, "--prompt-ids", "1")
    assert done.returncode == 2 and "holds no complete build" in one_line(done)


def test_the_help_describes_the_command_in_a_full_sentence() -> None:
    from flashrt_build.commands.generate_options import DESCRIPTION

    done = generate_cli("--help")
    assert done.returncode == 0
    assert DESCRIPTION.endswith(".") and DESCRIPTION in " ".join(done.stdout.split())
    assert "141 the reader closed the pipe" in " ".join(done.stdout.split())


@pytest.mark.slow
@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("nonsense", "expected cpu, cuda or cuda:N"),
        ("cpu:1", "the CPU has no devices by index: expected cpu"),  # module.checkpoint was named
        pytest.param(
            "cuda",
            "no CUDA device is usable on this machine",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here"),
        ),
    ],
)
def test_a_device_it_cannot_run_on_is_named_as_device(llama_lm_build: LlamaBuild, value: str, says: str) -> None:
    done = generate_cli(llama_lm_build[0].output_dir, "--prompt-ids", "1,2", "--device", value)
    assert done.returncode == 2
    assert one_line(done) == f"ConfigError: argument '--device' = {value!r}: {says}"  # not module.checkpoint


@pytest.mark.slow
def test_a_package_without_prefill_and_decode_is_named_with_its_methods(mlp_build: flashrt_build.BuildResult) -> None:
    done = generate_cli(mlp_build.output_dir, "--prompt-ids", "1,2")
    assert done.returncode == 2
    assert f"{mlp_build.output_dir} has no method 'prefill'; its methods: forward" in one_line(done)
    loaded = flashrt_build.load(mlp_build.output_dir)
    for given in ({}, {"prefill": "__init__"}):  # the Python API names them too
        with pytest.raises(ValueError, match=r"prefill='(prefill|__init__)': the package has no method .* forward$"):
            flashrt_build.generate(loaded, [1, 2], 2, **given)
    with pytest.raises(TypeError, match=r"host: expected the eager nn.Module the package stands in for, got int"):
        flashrt_build.load(mlp_build.output_dir, host=5)  # type: ignore[arg-type]


@pytest.mark.slow
def test_a_prompt_that_is_not_utf8_is_named(llama_lm_build: LlamaBuild) -> None:
    done = generate_cli(llama_lm_build[0].output_dir, "--prompt", b"ab\xff")
    assert done.returncode == 2
    assert one_line(done) == (
        "ConfigError: argument '--prompt' = b'ab\\xff': is not valid UTF-8 (byte b'\\xff' at offset 2)"
    )
    system = generate_cli(llama_lm_build[0].output_dir, "--prompt", "ab", "--chat", "--system", b"\xff")
    assert system.returncode == 2 and one_line(system).startswith("ConfigError: argument '--system' = b'\\xff'")
    stop = generate_cli(llama_lm_build[0].output_dir, "--prompt", "ab", "--stop", b"\xff")
    assert stop.returncode == 2 and one_line(stop).startswith("ConfigError: argument '--stop' = b'\\xff'")
    empty = generate_cli(llama_lm_build[0].output_dir, "--prompt-file", "/dev/null")
    assert one_line(empty).startswith("ConfigError: argument '--prompt-file' = '/dev/null': encodes to no tokens")


def _wait_for_handlers(process: subprocess.Popen[bytes]) -> None:
    """Until G has installed its SIGTERM handler (which Python has none of by itself)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status = Path(f"/proc/{process.pid}/status").read_text()
        caught = int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
        if caught & (1 << (signal.SIGTERM - 1)):
            return
        time.sleep(0.005)
    raise AssertionError("G never installed its signal handlers")


@pytest.mark.slow
@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_an_interrupt_is_one_line_and_the_shells_exit_code(
    llama_lm_build: LlamaBuild, signum: signal.Signals, code: int
) -> None:
    process = subprocess.Popen(
        [*G, str(llama_lm_build[0].output_dir), "--prompt-ids", "1,2", "--max-new-tokens", "60"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, **QUIET},
    )
    _wait_for_handlers(process)  # then loading: the import of torch alone takes seconds
    process.send_signal(signum)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == code
    assert stderr.decode() == f"interrupted by {signum.name}: generation stopped\n"
    assert stdout == b""


def test_an_interrupted_continuation_ends_its_line_before_the_message(capsys: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C mid-stream: the tokens printed so far get their newline, so the
    one line on stderr starts on its own in a terminal."""
    from flashrt_build.commands.text import Stream

    stream = Stream()
    stream(torch.tensor([[5]]))
    stream(torch.tensor([[7]]))
    stream.end_line()
    stream.end_line()  # once only
    assert capsys.readouterr().out == "5,7\n"


@pytest.mark.slow
def test_a_closed_pipe_ends_it_quietly_with_sigpipes_code(llama_lm_build: LlamaBuild) -> None:
    """`G ... | head -c 0`: the reader is gone before the first token; no
    traceback, no "Exception ignored", 141 as for a tool killed by SIGPIPE."""
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(
            [*G, str(llama_lm_build[0].output_dir), "--prompt", "ab", "--max-new-tokens", "20"],
            stdout=write,
            stderr=subprocess.PIPE,
            timeout=300,
            env={**os.environ, **QUIET, "TOKENIZERS_PARALLELISM": "false"},
        )
    finally:
        os.close(write)
    assert done.returncode == 141
    assert done.stderr == b""


# A serving host: torch and safetensors, nothing else. The command runs with
# the named top-level packages made unimportable.
WITHOUT = """
import runpy, sys
blocked = set(sys.argv[1].split(","))
class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in blocked:
            raise ImportError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Blocked())
sys.argv = ["python -m flashrt_build.generate", *sys.argv[2:]]
runpy.run_module("flashrt_build.generate", run_name="__main__", alter_sys=True)
"""


def without(blocked: str, *args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT, blocked, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, **QUIET},
    )


@pytest.mark.slow
def test_a_serving_host_without_tokenizer_libraries(llama_lm_build: LlamaBuild) -> None:
    out = llama_lm_build[0].output_dir
    ids = without("transformers,tokenizers", out, "--prompt-ids", "3,1,4", "--max-new-tokens", "3")
    assert ids.returncode == 0, ids.stderr
    assert len(ids.stdout.strip().split(",")) == 3

    text = without("transformers,tokenizers", out, "--prompt", "ab")
    assert text.returncode == 2 and "Traceback" not in text.stderr
    assert f"argument 'OUTPUT_DIR' = '{out}': --prompt's text: encoding text needs" in text.stderr
    assert "pip install tokenizers" in text.stderr

    plain = without("transformers", out, "--prompt", "ab", "--max-new-tokens", "3")
    assert plain.returncode == 0, plain.stderr  # a tokenizer.json through the tokenizers library
    chat = without("transformers", out, "--prompt", "ab", "--chat")
    assert chat.returncode == 2 and "argument '--chat'" in chat.stderr and "pip install transformers" in chat.stderr

    bare = without("torch", out, "--prompt-ids", "1,2")
    assert bare.returncode == 2 and "Traceback" not in bare.stderr
    assert "needs torch to run the package: pip install torch" in bare.stderr


# --- chat templates: code that came with the model -----------------------------

TEMPLATE = (
    "{% set c = messages[0]['content'] %}"
    "{% if c == 'raise' %}{{ raise_exception('no') }}"
    "{% elif c == 'undefined' %}{{ nothing.here }}"
    "{% elif c == 'escape' %}{{ ''.__class__.__mro__ }}"
    "{% elif c == 'huge range' %}{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
    "{% elif c == 'nested loops' %}{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}"
    "{% elif c == 'doubling' %}{% set ns = namespace(s='x') %}"
    "{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}"
    "{% elif c == 'surrogate' %}<{{ '\\ud800' }}>"
    "{% elif c == 'empty' %}"
    "{% elif c == 'slow' %}{% for a in 'x' * 100000 %}{% for b in 'x' * 100000 %}{% endfor %}{% endfor %}"
    "{% else %}<{{ c }}>{% if add_generation_prompt %}:{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def chat_lm(llama_lm_build: LlamaBuild, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The llama fixture's model with a chat template that misbehaves by
    the prompt, built into the same output root: its compiled package reused."""
    result, model_dir = llama_lm_build
    model = tmp_path_factory.mktemp("chat") / "llama_chat"
    shutil.copytree(model_dir, model)
    (model / "chat_template.jinja").write_text(TEMPLATE)
    sizes = ["module.max_cache_len=64", "module.max_prompt=32"]
    root = result.output_dir.parents[1]
    built = flashrt_build.build(
        compose(["+module=causal_lm", f"module.pretrained={model}", *sizes, "weights=external", f"output_root={root}"])
    )
    assert set(built.manifest["methods"][m]["compiled"] for m in ("prefill", "decode")) == {"reused"}
    return built.output_dir


@pytest.mark.slow
def test_a_chat_template_renders_as_transformers_does(chat_lm: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_lm)
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": "ab"}], add_generation_prompt=True, return_dict=False
    )
    assert expected == tokenizer.encode("<ab>:")
    done = generate_cli(chat_lm, "--prompt", "ab", "--chat", "--max-new-tokens", "2")
    assert done.returncode == 0, done.stderr
    assert f"prompt: {len(expected)} tokens in" in done.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("prompt", "says"),
    [
        ("raise", "TemplateError: no (line 1)"),
        ("undefined", "UndefinedError: 'nothing' is undefined"),
        ("escape", "SecurityError: access to attribute '__class__' of 'str' object is unsafe"),
        ("huge range", "range() of 100000 items: a chat template may take at most 10000"),
        ("nested loops", "its range() loops run more than 1000000 times"),
        ("doubling", "it needed more than 1024 MiB to render"),
        ("slow", "it took more than 10 s to render"),
        ("surrogate", "it renders a lone surrogate ('\\ud800' at character 1), which is not text"),
        ("empty", "it renders no text; the package needs at least one"),  # the prompt was blamed
    ],
)
def test_a_chat_template_that_raises_or_passes_a_bound_is_named(chat_lm: Path, prompt: str, says: str) -> None:
    started = time.monotonic()
    done = generate_cli(chat_lm, "--prompt", prompt, "--chat")
    assert done.returncode == 2 and done.stdout == ""
    line = one_line(done)
    assert f"the chat template in {chat_lm / 'chat_template.jinja'} cannot be applied" in line and says in line
    assert time.monotonic() - started < 60  # bounded: 2.3 GB and 45 s before, for nested range(100000)


# --- messages name the key the user set ---------------------------------------------


@pytest.mark.slow
def test_a_prompt_the_package_was_not_built_for_names_the_causal_lm_key(llama_lm_build: LlamaBuild) -> None:
    out = llama_lm_build[0].output_dir
    long = generate_cli(out, "--prompt-ids", ",".join(["1"] * 40), "--max-new-tokens", "4")
    assert long.returncode == 2
    assert one_line(long) == (
        "PromptRefused: config key 'module.max_prompt' = 32: the prompt has 40 tokens, more than the package's "
        "prefill takes; rebuild with module.max_prompt=40"
    )
    room = generate_cli(out, "--prompt-ids", "1,2,3", "--max-new-tokens", "70", "--ignore-eos")
    assert room.returncode == 0 and len(room.stdout.strip().split(",")) == 61  # to the cache's end, then a note
    assert room.stderr.splitlines()[-1] == (
        "stopped at the cache's end after 61 new tokens: config key 'module.max_cache_len' = 64: the prompt "
        "(3 tokens) and 70 new tokens need positions up to 72, the package's cache holds 64; rebuild with "
        "module.max_cache_len=73, or ask for at most 61 new tokens"
    )
    both = generate_cli(out, "--prompt-ids", ",".join(["1"] * 60), "--max-new-tokens", "10")
    assert "rebuild with module.max_prompt=60 module.max_cache_len=70" in one_line(both)

    model = flashrt_build.load(out)
    with pytest.raises(PromptRefused, match=r"'module.batch' = 1: .* holds 2; rebuild with module.batch=2"):
        flashrt_build.generate(model, torch.ones(2, 3, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match=r"'module.max_cache_len' = 64: .* rebuild with module.max_cache_len=73"):
        flashrt_build.generate(model, torch.ones(1, 3, dtype=torch.int64), 70)
    with pytest.raises(ValueError, match=r"'module.max_prompt' = 32: the prompt has 33 tokens"):
        flashrt_build.generate(model, torch.ones(1, 33, dtype=torch.int64), 1)
    assert all(t.abs().sum() == 0 for t in model.state.values())  # refused before any call
    assert flashrt_build.generate(model, torch.ones(1, 3, dtype=torch.int64), 61).tokens.shape == (1, 61)


def test_a_sampling_setting_that_is_not_finite_is_refused_by_the_api() -> None:
    with pytest.raises(ValueError, match="finite temperature"):
        flashrt_build.generate(object(), torch.ones(1, 3, dtype=torch.int64), 4, temperature=float("nan"))


# --- round 4: what the hostile tester found ---------------------------------------


@pytest.mark.slow
def test_any_entry_the_manifest_does_not_list_is_refused_before_a_tokenizer_reads_it(
    llama_lm_build: LlamaBuild, tmp_path: Path
) -> None:
    """transformers' AutoTokenizer reads more than a fixed list of names:
    `additional_chat_templates/default.jinja` replaced the chat template
    (exit 0, another prompt). Every entry the build did not write is refused."""
    result, _ = llama_lm_build
    out = copy_build(result.output_dir, tmp_path / "out")
    injected = out / "additional_chat_templates"
    injected.mkdir()
    (injected / "default.jinja").write_text("INJECTED {{ messages[0]['content'] }} INJECTED")
    done = generate_cli(out, "--prompt", "ab", "--chat", "--max-new-tokens", "2")
    assert done.returncode == 1 and done.stdout == ""
    assert one_line(done) == (
        f"ArtifactError: {out} holds entries its build did not write (its manifest does not list them), which a "
        "tokenizer may read: additional_chat_templates; refusing to serve from it"
    )
    shutil.rmtree(injected)
    (out / "notes.txt").write_text("mine")  # any name, not only a tokenizer's
    (out / "special_tokens_map.json").write_text("{}")
    line = one_line(generate_cli(out, "--prompt-ids", "1,2", "--max-new-tokens", "2"))
    assert line.endswith("which a tokenizer may read: notes.txt, special_tokens_map.json; refusing to serve from it")
    (out / "notes.txt").unlink()
    (out / "special_tokens_map.json").unlink()
    assert generate_cli(out, "--prompt", "ab", "--chat", "--max-new-tokens", "2").returncode == 0


def test_a_fifo_or_a_device_in_a_files_place_is_named_and_never_opened(tmp_path: Path) -> None:
    from flashrt_build.runtime.hashing import check_file

    os.mkfifo(tmp_path / "tokenizer.json")  # opened, it would block
    (tmp_path / "zero.json").symlink_to("/dev/zero")  # read, it never ends
    (tmp_path / "dir.json").mkdir()
    record = {"sha256": "0" * 64, "bytes": 1}
    for name, says in (
        ("tokenizer.json", "is a FIFO, not a regular file"),
        ("zero.json", "is a link to /dev/zero, a character device, not a regular file"),
        ("dir.json", "is a directory, not a regular file"),
        ("gone.json", "is missing"),
    ):
        with pytest.raises(ArtifactError, match=rf"^{re.escape(str(tmp_path / name))} \(a served file\) {says}; "):
            check_file(tmp_path, {**record, "file": name}, "a served file")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fifo", "zero"])
def test_a_served_file_or_manifest_that_is_no_regular_file_is_said_as_what_it_is(
    llama_lm_build: LlamaBuild, tmp_path: Path, kind: str
) -> None:
    """Was "is missing" / "does not exist", and a FIFO manifest exit 1 where a missing one is 2."""
    result, _ = llama_lm_build
    says = "is a FIFO" if kind == "fifo" else "is a link to /dev/zero, a character device"

    def replace(path: Path) -> None:
        path.unlink()
        os.mkfifo(path) if kind == "fifo" else path.symlink_to("/dev/zero")

    out = copy_build(result.output_dir, tmp_path / "served")
    replace(out / "tokenizer.json")
    for args in (["--prompt", "ab"], ["--prompt-ids", "1,2"]):
        done = generate_cli(out, *args, "--max-new-tokens", "2")
        assert done.returncode == 1, done.stderr  # a package file not as its build wrote it
        assert one_line(done) == (
            f"ArtifactError: {out / 'tokenizer.json'} (a file served beside the package) {says}, not a regular "
            "file; refusing to load it"
        )
    with pytest.raises(ArtifactError, match=f"{re.escape(str(out / 'tokenizer.json'))} .* {says}, not a regular"):
        flashrt_build.load(out)

    out = copy_build(result.output_dir, tmp_path / "manifest")
    replace(out / "manifest.json")
    done = generate_cli(out, "--prompt", "ab", "--max-new-tokens", "2")
    assert done.returncode == 2  # as a missing manifest: no build here
    assert one_line(done) == (
        f"UsageError: {out / 'manifest.json'} {says}, not a regular file: {out} holds no complete build"
    )
    with pytest.raises(ArtifactError, match=f"manifest.json {says}, not a regular file: .* holds no complete build"):
        flashrt_build.load(out)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full")
def test_stdout_that_cannot_be_written_or_is_closed_is_one_line(llama_lm_build: LlamaBuild) -> None:
    out = llama_lm_build[0].output_dir
    env = {**os.environ, **QUIET, "TOKENIZERS_PARALLELISM": "false"}
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [*G, str(out), "--prompt", "ab", "--max-new-tokens", "4"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
            env=env,
        )
    assert done.returncode == 1
    assert done.stderr == "StdoutError: cannot write to stdout: No space left on device\n"  # not UnexpectedError

    closed = subprocess.run(  # `>&-`: every token was lost and the exit code 0
        ["bash", "-c", 'exec "$@" >&-', "generate", *G, str(out), "--prompt", "ab", "--max-new-tokens", "4"],
        stderr=subprocess.PIPE,
        text=True,
        timeout=300,
        env=env,
    )
    assert closed.returncode == 2
    assert closed.stderr == (
        "UsageError: cannot write to stdout: it is closed (>&-), and every generated token would be lost\n"
    )


@pytest.mark.slow
def test_load_refuses_a_device_the_package_cannot_run_on_naming_the_argument(
    llama_lm_build: LlamaBuild, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Was `config key 'module.checkpoint' = '.../weights.safetensors': is not a readable safetensors file`."""
    from flashrt_build.errors import ConfigError
    from flashrt_build.runtime import binding

    out = llama_lm_build[0].output_dir
    monkeypatch.setattr(binding, "read_checkpoint", lambda *a, **k: pytest.fail("read weights before the device"))
    cases = [
        ("meta", "the package was built for cpu (target.device): its code runs there"),
        (torch.device("meta"), "the package was built for cpu (target.device): its code runs there"),
        ("nonsense", "expected cpu, cuda or cuda:N"),
        ("cpu:1", "the CPU has no devices by index: expected cpu"),  # module.checkpoint was named
    ]
    if not torch.cuda.is_available():
        cases += [(name, "no CUDA device is usable on this machine") for name in ("cuda", "cuda:7")]
    for device, says in cases:
        with pytest.raises(ConfigError) as info:
            flashrt_build.load(out, device=device)
        assert (info.value.kind, info.value.key, info.value.value) == ("argument", "device", str(device))
        assert says in str(info.value) and "module.checkpoint" not in str(info.value)


@pytest.mark.slow
def test_a_direct_call_of_a_causal_lm_package_names_the_key_the_user_set(llama_lm_build: LlamaBuild) -> None:
    """Was `module.methods.decode.inputs.position.low/high`, a key derived from module.max_cache_len."""
    model = flashrt_build.load(llama_lm_build[0].output_dir)
    token = torch.tensor([[1]])
    with pytest.raises(ValueError) as position:
        model.decode(token, position=torch.tensor([64]))
    assert str(position.value) == (
        "input 'position' holds values from 64 to 64; the package accepts 0 to 63 (module.max_cache_len = 64: the "
        "positions its cache holds): a value outside would make its code read out of bounds"
    )
    with pytest.raises(ValueError) as prompt:
        model.prefill(torch.ones(1, 33, dtype=torch.int64))
    assert str(prompt.value) == (
        "input 'input_ids' has size 33 on axis 1 ('prompt'); the package accepts 1 to 32 (module.max_prompt = 32: "
        "the longest prompt its prefill takes)"
    )
    with pytest.raises(ValueError) as batch:
        model.prefill(torch.ones(2, 3, dtype=torch.int64))
    assert str(batch.value) == (
        "input 'input_ids' has size 2 on axis 0; the package was built for 1 there (module.batch = 1: the sequences "
        "it decodes at once)"
    )
    assert not any("module.methods" in str(e.value) for e in (position, prompt, batch))


def test_a_rebuild_is_not_suggested_past_the_models_positions() -> None:
    """The model has 256 positions: `module.max_cache_len=1002` would itself be refused."""
    from flashrt_build.runtime.sizes import BuiltSizes, check_request

    sizes = BuiltSizes(batch=1, max_prompt=32, max_cache_len=64)
    cases = [
        (2, 1000, 256, "the model has 256 positions (its config.json's max_position_embeddings): rebuild with "
         "module.max_cache_len=256 to ask for at most 254 new tokens, or ask for at most 62 new tokens"),
        (2, 1000, 64, "the model has 64 positions (its config.json's max_position_embeddings), all of them in this "
         "cache: ask for at most 62 new tokens"),
        (2, 1000, None, "rebuild with module.max_cache_len=1002, or ask for at most 62 new tokens"),  # unknown
        (2, 100, 256, "rebuild with module.max_cache_len=102, or ask for at most 62 new tokens"),  # within the model
        (60000, 2, 256, "the model has 256 positions (its config.json's max_position_embeddings), so no build of it "
         "takes a prompt of 60000 tokens: give one of at most 255"),
        (100, 200, 256, "the model has 256 positions (its config.json's max_position_embeddings): rebuild with "
         "module.max_prompt=100 module.max_cache_len=256 and ask for at most 156 new tokens"),
        (40, 4, 256, "rebuild with module.max_prompt=40"),
    ]  # fmt: skip
    for length, new, positions, says in cases:
        with pytest.raises(PromptRefused) as info:
            check_request(sizes, 1, length, new, lambda p=positions: p)
        assert str(info.value).endswith(says), (length, new, positions, str(info.value))


@pytest.mark.slow
def test_the_advice_for_a_prompt_the_package_cannot_take_reads_the_models_positions(
    llama_lm_build: LlamaBuild,
) -> None:
    out = llama_lm_build[0].output_dir  # the model has 256 positions
    done = generate_cli(out, "--prompt-ids", "1,2", "--max-new-tokens", "1000", "--ignore-eos")
    assert done.returncode == 0
    assert done.stderr.splitlines()[-1] == (
        "stopped at the cache's end after 62 new tokens: config key 'module.max_cache_len' = 64: the prompt "
        "(2 tokens) and 1000 new tokens need positions up to 1001, the package's cache holds 64; the model has 256 "
        "positions (its config.json's max_position_embeddings): rebuild with module.max_cache_len=256 to ask for "
        "at most 254 new tokens, or ask for at most 62 new tokens"
    )
    model = flashrt_build.load(out)
    with pytest.raises(PromptRefused, match=r"no build of it takes a prompt of 300 tokens: give one of at most 255$"):
        flashrt_build.generate(model, torch.ones(1, 300, dtype=torch.int64), 2)


def test_a_seed_torch_cannot_take_is_refused_by_the_api_naming_seed() -> None:
    for seed in (2**64, 2**63, -1, 1.5, True):
        with pytest.raises(ValueError, match=rf"^seed = {re.escape(repr(seed))}: expected an integer with 0 <= seed"):
            flashrt_build.generate(object(), torch.ones(1, 3, dtype=torch.int64), 4, temperature=1.0, seed=seed)


@pytest.mark.slow
def test_a_prompt_file_without_end_and_a_tmpdir_that_is_none_are_named(llama_lm_build: LlamaBuild) -> None:
    out = llama_lm_build[0].output_dir
    endless = generate_cli(out, "--prompt-file", "/dev/zero", "--max-new-tokens", "2")
    assert endless.returncode == 2 and "'--prompt-file' = '/dev/zero': holds more than 64 MiB" in one_line(endless)
    no_tmp = generate_cli(out, "--prompt-ids", "1,2", env={"TMPDIR": "/nonexistent"})
    assert no_tmp.returncode == 2
    assert "environment variable 'TMPDIR' = '/nonexistent': no such directory" in no_tmp.stderr


@pytest.mark.slow
def test_the_apis_arguments_are_named_before_any_call(llama_lm_build: LlamaBuild) -> None:
    model = flashrt_build.load(llama_lm_build[0].output_dir)
    with pytest.raises(ValueError, match=r"prompt: expected at least one token id"):
        flashrt_build.generate(model, [], 2)
    with pytest.raises(ValueError, match=r"each an integer from 0 to 2\*\*63 - 1"):
        flashrt_build.generate(model, [1, 2**70], 2)
    with pytest.raises(TypeError, match=r"stop: expected a function \(or None\), got list"):
        flashrt_build.generate(model, [1, 2], 2, stop=[""])
    with pytest.raises(ValueError, match=r"max_new_tokens must be an integer >= 1, got 2.5"):
        flashrt_build.generate(model, [1, 2], 2.5)
    assert all(bool(t.abs().sum() == 0) for t in model.state.values())  # refused before any call
    with pytest.raises(TypeError, match=r"got str '\+module=mlp'; compose\(\['\+module=mlp'\]\) composes it"):
        flashrt_build.build("+module=mlp")
    with pytest.raises(flashrt_build.ConfigError, match=r"config key 'module' = 'mlp': Invalid type"):
        flashrt_build.build({"module": "mlp"})


@pytest.mark.slow
def test_text_longer_than_any_prompt_the_cache_holds_is_refused_before_it_is_tokenized(
    llama_lm_build: LlamaBuild, tmp_path: Path
) -> None:
    """A tokenizer that runs out of memory aborts the process (rc 134), whatever Python catches."""
    result, _ = llama_lm_build
    big = tmp_path / "big.txt"
    big.write_text("a" * (2 << 20))
    line = one_line(generate_cli(result.output_dir, "--prompt-file", big, "--max-new-tokens", "2"))
    assert f"argument '--prompt-file' = '{big}'" in line and "is longer than any prompt of the package's" in line
    done = generate_cli(result.output_dir, "--interactive", "--max-new-tokens", "1", input_text="a" * (2 << 20) + "\n")
    assert done.returncode == 0 and "that line is longer than any prompt of the package's" in done.stderr
    with pytest.raises(ValueError, match=r"prompt: is longer than any prompt of the package's \d+ positions"):
        flashrt_build.generate(result.output_dir, "a" * (2 << 20), max_new_tokens=1)  # the Python API too
