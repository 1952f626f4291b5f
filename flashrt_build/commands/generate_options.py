"""`python -m flashrt_build.generate`'s command line: its flags, as the
tools people know name them (transformers' generate, llama.cpp, vLLM), and
each one checked before anything is read, refused naming the flag."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any, NoReturn

from ..runtime.threads import THREADS_PER_CORE, max_threads, threads_expected
from .text import MAX_SEED, argument, parse_ids, utf8

PROG = "python -m flashrt_build.generate"
DESCRIPTION = (
    "Generate text from a built package of a prefill and a decode method (a causal_lm build), "
    "its prompt encoded with the tokenizer copied beside the package and its continuation printed as it is generated."
)
EPILOG = (
    "exit codes: 0 done; 1 the package or a call failed; 2 a wrong command line or input; "
    "130/143 interrupted by Ctrl-C/SIGTERM; 141 the reader closed the pipe"
)


class _Parser(argparse.ArgumentParser):
    """argparse with its refusals on one line, as every other failure."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("output_dir", type=Path)
    given = parser.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt", help="the prompt's text (needs the tokenizer the build copied)")
    given.add_argument("--prompt-file", type=Path, help="the prompt's text from a file; - reads standard input")
    given.add_argument("--prompt-ids", help="the prompt's token ids, comma-separated (1,2,3)")
    given.add_argument(
        "--interactive",
        action="store_true",
        help="a conversation: a turn a line of standard input, the KV cache kept between turns; /reset starts over",
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (the default): greedy")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument(
        "--seed", type=int, default=None, help="seeds sampling (default: from the system, printed to repeat a run)"
    )
    parser.add_argument(
        "--repetition-penalty", type=float, default=1.0, help="above 1: tokens the text holds are less likely"
    )
    parser.add_argument("--stop", action="append", default=[], help="stop where the text holds this (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="generate past the end-of-sequence tokens")
    parser.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template to the prompt")
    parser.add_argument("--system", default=None, help="with --chat: a system message before the prompt")
    parser.add_argument("--weights", type=Path, default=None, help="a checkpoint to serve instead of the build's")
    parser.add_argument("--json", action="store_true", help="print one JSON object (text, ids, timings) at the end")
    parser.add_argument("--device", default=None, help="default: the build's target")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help=f"CPU threads a call runs on, at most {THREADS_PER_CORE} times the cores (default: the cores other "
        "work leaves idle)",
    )
    return parser


def check_flags(args: argparse.Namespace) -> dict[str, Any]:
    """Every flag in its range, before anything is read; the generation's
    keyword arguments (`flashrt_build.generate`'s)."""
    if args.max_new_tokens < 1:
        raise argument("--max-new-tokens", args.max_new_tokens, "expected an integer >= 1")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise argument("--temperature", args.temperature, "expected a finite number >= 0 (0: greedy)")
    if args.top_k is not None and args.top_k < 1:
        raise argument("--top-k", args.top_k, "expected an integer >= 1")
    if args.top_p is not None and not 0 < args.top_p <= 1:  # NaN too
        raise argument("--top-p", args.top_p, "expected a number in (0, 1]")
    if args.seed is not None and not 0 <= args.seed < MAX_SEED:
        raise argument("--seed", args.seed, "expected 0 <= seed < 2**63")
    if not (math.isfinite(args.repetition_penalty) and args.repetition_penalty > 0):
        raise argument("--repetition-penalty", args.repetition_penalty, "expected a number > 0 (1: none)")
    if args.threads is not None and not 1 <= args.threads <= max_threads():
        raise argument("--threads", args.threads, threads_expected())
    if args.system is not None and not args.chat:
        raise argument("--system", args.system, "a system message goes through the chat template: add --chat")
    if args.stop and args.prompt_ids is not None:
        raise argument("--stop", args.stop[0], "stop strings are text; --prompt-ids prints token ids")
    if any(not stop for stop in args.stop):
        raise argument("--stop", "", "expected a non-empty string")
    for stop in args.stop:  # bytes that are not UTF-8 reach argv as surrogates: a stop that never matches
        utf8(stop, "--stop")
    if args.interactive and args.json:
        raise argument("--json", True, "prints one generation's record; --interactive holds a conversation")
    if args.prompt_ids is not None:
        parse_ids(args.prompt_ids)  # a malformed list is the command line's mistake, named before anything is read
    return {
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "seed": args.seed,
        "repetition_penalty": args.repetition_penalty,
    }
