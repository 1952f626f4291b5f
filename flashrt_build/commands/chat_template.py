"""A tokenizer's chat template rendered under bounds: a template is code from
whoever made the model, and one with nested `range(100000)` loops grew to
2.3 GB in 45 s rendering in the serving process.

`render` runs transformers' own renderer (its sandboxed jinja2 environment,
`render_jinja_template`) in a child process (`python -m
flashrt_build.commands.chat_template`) whose address space is capped, whose
render is stopped past a time limit, and whose `range` takes at most
`MAX_RANGE` items a call and `MAX_ITERATIONS` in all; the rendered text is at
most `MAX_CHARS` characters.
A template that raises, escapes the sandbox or passes a bound is a
`ChatTemplateError` (exit 2) naming the file it came from.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import FlashrtError

TIMEOUT_S = 10.0  # the render itself, timed in the child once its imports are done
STARTUP_S = 60.0  # more for the child to start and import the renderer (0.7 s here, longer on a loaded host)
MEMORY_BYTES = 1 << 30  # the child's address space beyond its start (the renderer's import takes about 0.2 GB)
MAX_RANGE = 10_000  # items of one `range()` (jinja2's sandbox allows 100,000)
MAX_ITERATIONS = 1_000_000  # items of every `range()` of one render together
MAX_CHARS = 4 << 20  # the rendered text: far more than any prompt a package takes


class ChatTemplateError(FlashrtError):
    """A chat template that cannot be rendered within the bounds (exit code 2)."""

    exit_code = 2


def render(template: str, messages: list[dict[str, str]], variables: Mapping[str, Any], source: Path) -> str:
    """`template` applied to `messages` with `add_generation_prompt` and
    `variables` (the tokenizer's special tokens), as transformers'
    `apply_chat_template` renders it, in a bounded child process."""
    request = json.dumps({"template": template, "messages": messages, "variables": dict(variables)}, default=str)
    try:
        done = subprocess.run(
            [sys.executable, "-m", __name__],
            input=request,
            capture_output=True,
            text=True,
            timeout=STARTUP_S + TIMEOUT_S,  # a backstop: the child times the render itself
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise refused(source, f"its render process did not end in {STARTUP_S + TIMEOUT_S:g} s") from None
    try:
        answer = json.loads(done.stdout)
    except ValueError:
        said = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise refused(source, f"its render process failed ({said})") from None
    if "error" in answer:
        raise refused(source, answer["error"])
    text = answer["text"]
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # `{{ '\\ud800' }}`: no tokenizer encodes it
        raise refused(
            source, f"it renders a lone surrogate ({text[exc.start]!r} at character {exc.start}), which is not text"
        ) from None
    return text


def refused(source: Path, why: str) -> ChatTemplateError:
    """The chat template of `source` (its file) cannot be applied, and why (exit code 2)."""
    return ChatTemplateError(f"the chat template in {source} cannot be applied to the prompt: {why}")


def _child() -> int:
    """The render process: a request on stdin, `{"text"}` or `{"error"}` on stdout."""
    limit = _address_space() + MEMORY_BYTES
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    cpu = int(STARTUP_S + TIMEOUT_S)  # a backstop should the parent be gone
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    request = json.loads(sys.stdin.read())
    try:
        answer = {"text": _render_here(request)}
    except MemoryError:
        answer = {"error": f"it needed more than {MEMORY_BYTES >> 20} MiB to render"}
    except _TimedOut:
        answer = {"error": f"it took more than {TIMEOUT_S:g} s to render"}
    except Exception as exc:  # the template's own error: raise_exception, an undefined name, the sandbox
        answer = {"error": f"{type(exc).__name__}: {exc}{_template_line(exc)}"}
    sys.stdout.write(json.dumps(answer))
    return 0


def _address_space() -> int:
    """Bytes this process maps now (the interpreter, whatever its site imported)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _render_here(request: Mapping[str, Any]) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    _bound_ranges(request["template"])
    signal.signal(signal.SIGALRM, _time_out)
    signal.setitimer(signal.ITIMER_REAL, TIMEOUT_S)
    try:
        rendered, _ = render_jinja_template(
            conversations=[request["messages"]],
            chat_template=request["template"],
            add_generation_prompt=True,
            **request["variables"],
        )
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    text = rendered[0]
    if len(text) > MAX_CHARS:
        raise OverflowError(f"it renders {len(text)} characters, more than {MAX_CHARS}")
    return text


def _bound_ranges(template: str) -> None:
    """`range` in the environment transformers compiles `template` in (and
    caches: the render uses this one) takes `_BoundedRange`'s bounds."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # a transformers that compiles otherwise: the time and memory bounds still hold
        return
    _compile_jinja_template(template).environment.globals["range"] = _BoundedRange.of


class _TimedOut(BaseException):
    """The render's time is up (a BaseException: the template's own handlers do not catch it)."""


def _time_out(signum: int, frame: object) -> None:
    raise _TimedOut


def _template_line(exc: BaseException) -> str:
    """` (line N)` of the template where jinja2 raised, when its traceback says."""
    line = getattr(exc, "lineno", None)
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return f" (line {line})" if line else ""


class _BoundedRange(Sequence[int]):
    """`range()` inside a template: at most MAX_RANGE items a call, and at
    most MAX_ITERATIONS iterated over in one render, so nested loops end."""

    left = [MAX_ITERATIONS]  # what this render may still iterate

    def __init__(self, items: range) -> None:
        self._items = items

    @classmethod
    def of(cls, *args: int) -> _BoundedRange:
        items = range(*args)
        if len(items) > MAX_RANGE:
            raise OverflowError(f"range() of {len(items)} items: a chat template may take at most {MAX_RANGE}")
        return cls(items)

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: Any) -> Any:
        return self._items[index]

    def __iter__(self) -> Iterator[int]:
        for item in self._items:
            self.left[0] -= 1
            if self.left[0] < 0:
                raise OverflowError(f"its range() loops run more than {MAX_ITERATIONS} times")
            yield item


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(_child())
