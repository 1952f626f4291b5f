"""`python -m flashrt_build.generate OUTPUT_DIR --prompt TEXT` generates text
from a package of a prefill and a decode method (`causal_lm`'s).

The prompt is encoded with the tokenizer the build copied beside the package
(transformers' `AutoTokenizer` when installed, else the `tokenizers` library
for a `tokenizer.json`), each of its files checked against the manifest's
digest first; `--chat` applies its chat template, rendered under bounds
(chat_template.py). The continuation is printed as it is generated,
generation stops at the model's end-of-sequence tokens (its
generation_config.json), and the prompt's and the decode's speed end the
output on stderr. `--prompt-ids 1,2,3` serves a package without a tokenizer
(torch and safetensors are all it needs), printing token ids. The flags are
the ones people know from transformers and llama.cpp (generate_options.py):
sampling, a repetition penalty, stop strings, a system message, a prompt
from a file or stdin, another checkpoint, JSON out; a conversation
(`--interactive`: chat.py); a generation that reaches the cache's end
stops there, with a note.

Exit codes, as the build command's: 0 done; 1 the package or a call failed
(a file altered since its build); 2 a wrong command line or input (a flag out
of range, a prompt the package was not built for, a chat template that raises,
passes its bounds or renders no tokens, a tokenizer that needs code of its
own (`auto_map`), a library the request needs that is not installed);
130 / 143 interrupted by Ctrl-C / SIGTERM; 141 (as a tool killed by SIGPIPE)
when the reader closed the pipe (`| head`), quietly. Every failure is one
line on stderr; FLASHRT_TRACEBACK=1 adds the traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from ..config.paths import check_temp_dir
from ..errors import (
    FlashrtError,
    Interrupted,
    exit_interrupted,
    report_failure,
    stop_on_signals,
)
from ..runtime.manifest import NoBuild, manifest_methods, read_manifest
from ..runtime.tokenizer import check_serving_dir, eos_tokens
from .generate_options import PROG, check_flags, parser
from .text import StdoutError, Stream, print_json, print_speed, prompt_ids

EXIT_PIPE_CLOSED = 128 + signal.SIGPIPE  # what a shell reports for a tool killed by SIGPIPE
METHODS = ("prefill", "decode")  # what `generate` calls

log = logging.getLogger("flashrt_build.generate")


class UsageError(FlashrtError):
    """The package or this machine cannot serve what was asked (exit code 2)."""

    exit_code = 2


def main(argv: list[str] | None = None) -> int:
    """`python -m flashrt_build.generate OUTPUT_DIR (--prompt TEXT | --prompt-ids IDS) [options]`."""
    args = parser().parse_args(argv)
    _report_to_stderr()
    stop_on_signals()
    stream = Stream()
    try:
        try:
            _check_stdout()
            return _generate(args, stream)
        except BrokenPipeError:
            return _pipe_closed()
        except StdoutError as exc:  # /dev/full: one line; the buffered tokens cannot be written at exit either
            _stdout_to_devnull()
            return report_failure(log, exc, "generate failed").exit_code
        except Exception as exc:  # raised on purpose or not: one line, the exit code of its kind
            return report_failure(log, exc, "generate failed").exit_code
    except Interrupted as stopped:
        with contextlib.suppress(OSError, StdoutError):  # stdout may be a closed pipe, a full disk
            stream.end_line()
        name = signal.Signals(stopped.signum).name
        exit_interrupted(stopped, lambda _: print(f"interrupted by {name}: generation stopped", file=sys.stderr))


def _report_to_stderr() -> None:
    """Failures as one line on stderr (`ConfigError: argument '--top-p' = 2.0: ...`)."""
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.propagate = False


def _pipe_closed() -> int:
    """The reader is gone (`| head -c 5`): stop, and leave nothing for the
    interpreter's last flush to complain about."""
    _stdout_to_devnull()
    return EXIT_PIPE_CLOSED


def _stdout_to_devnull() -> None:
    """What is left in stdout's buffer goes nowhere at exit (it could not be
    written: a closed pipe, a full disk), rather than as "Exception ignored"."""
    with contextlib.suppress(OSError, ValueError):  # no descriptor to replace: nothing will be flushed to it
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _check_stdout() -> None:
    """The continuation goes to stdout: with stdout closed (`>&-`) every
    token would be lost, silently (Python's print writes nowhere then)."""
    stdout = sys.stdout
    if stdout is None:
        raise UsageError("cannot write to stdout: it is closed (>&-), and every generated token would be lost")
    try:
        os.fstat(stdout.fileno())
    except io.UnsupportedOperation:  # a stream of Python's own (a test's capture): written as any other
        return
    except (OSError, ValueError) as exc:
        raise UsageError(
            f"cannot write to stdout: it is closed ({exc}), and every generated token would be lost"
        ) from None


def _generate(args: argparse.Namespace, stream: Stream) -> int:
    sampling = check_flags(args)
    manifest = _manifest(args.output_dir)
    _check_methods(args.output_dir, manifest)
    check_serving_dir(args.output_dir, manifest)
    tokenizer, ids = prompt_ids(args, manifest)
    check_temp_dir()  # a package unpacks its libraries there: a TMPDIR that cannot hold them, named
    torch, load, generate = _runtime()
    device = _device(args.device, manifest)
    model = load(args.output_dir, weights=args.weights, device=device, threads=_threads(args.threads, device))
    if args.interactive:
        from .chat import converse

        eos = None if args.ignore_eos else eos_tokens(args.output_dir, tokenizer)
        return converse(args, model, tokenizer, generate, _room, eos=eos, **sampling)
    prompt = torch.tensor([ids], dtype=torch.int64, device=model.device)
    stream.tokenizer, stream.stops, stream.quiet = tokenizer, tuple(args.stop), args.json
    eos = None if args.ignore_eos else eos_tokens(args.output_dir, tokenizer)
    new, full = _room(model, len(ids), args.max_new_tokens)
    result = generate(model, prompt, new, eos=eos, timed=True, on_token=stream, stop=lambda: stream.stopped, **sampling)
    stream.end()
    stopped = "cache" if result.stopped == "length" and new < args.max_new_tokens else result.stopped
    if args.json:
        print_json(ids, result, stream, stopped, model.threads)
        return 0
    print_speed(len(ids), result, model.threads)
    if stopped == "cache":
        print(f"stopped at the cache's end after {new} new tokens: {full}", file=sys.stderr)
    if result.seed is not None:  # what repeats this run's tokens
        print(f"seed: {result.seed} (--seed {result.seed} repeats these tokens)", file=sys.stderr)
    return 0


def _room(model: Any, prompt: int, asked: int, decoded: bool = False) -> tuple[int, str | None]:
    """The new tokens to generate: as asked, or as many as the cache holds
    after the prompt, with why in the words of the key that would build a
    longer one (a prompt the package does not take is refused as ever;
    `decoded`, a conversation's turn decoded from the cache, is bounded by
    the cache alone)."""
    from ..runtime.sizes import PromptRefused, built_sizes, check_request, model_positions

    sizes = built_sizes(model, "prefill", "decode", "position")
    if sizes is None:
        return asked, None
    try:
        check_request(sizes, sizes.batch, prompt, asked, lambda: model_positions(model.manifest), prefilled=not decoded)
    except PromptRefused as full:
        if full.key != "module.max_cache_len" or sizes.max_cache_len <= prompt:
            raise
        return sizes.max_cache_len - prompt, str(full)
    return asked, None


def _manifest(output_dir: Path) -> dict[str, Any]:
    """The build's manifest; a directory that holds no build (no manifest, or
    a FIFO or a device in its place) is the command line's mistake."""
    try:
        return read_manifest(output_dir)
    except NoBuild as exc:
        raise UsageError(str(exc)) from None


def _check_methods(output_dir: Path, manifest: dict[str, Any]) -> None:
    methods = manifest_methods(manifest)
    for name in METHODS:
        if name not in methods:
            raise UsageError(
                f"{output_dir} has no method '{name}'; its methods: {', '.join(methods)} (generate serves a package "
                "of a prefill and a decode method, as +module=causal_lm builds)"
            )


def _threads(given: int | None, device: Any) -> int | None:
    """The CPU threads of a CPU package's calls: as given, else the cores
    other work leaves idle (every thread past them waits on a busy core)."""
    if given is not None or device.type != "cpu":  # a count below 1 was refused with the other flags
        return given
    from ..runtime.threads import idle_cpus

    return idle_cpus()


def _runtime() -> tuple[Any, Any, Any]:
    """torch, `load` and `generate`: what a serving host installs (torch and safetensors)."""
    try:
        import torch

        from ..runtime.generate import generate
        from ..runtime.load import load
    except ImportError as exc:
        missing = (exc.name or "").split(".")[0]
        if missing not in ("torch", "safetensors"):
            raise
        raise UsageError(f"{PROG} needs {missing} to run the package: pip install {missing}") from None
    return torch, load, generate


def _device(given: str | None, manifest: dict[str, Any]) -> Any:
    """The device to run on, refused naming --device where the package cannot
    run there (the check `load` makes of its `device` argument)."""
    from ..runtime.gpu import check_device

    return check_device(given, manifest["target"]["device"], "--device")
