"""One exception type per kind of failure, each mapped to one exit code.

Every message states the rule, the offending value and what was expected, so
the CLI can print it as one line without a traceback.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import NoReturn, TypeVar

T = TypeVar("T")


class FlashrtError(Exception):
    """Base class of every error flashrt_build raises on purpose."""

    exit_code = 1


class ConfigError(FlashrtError):
    """The config or the command line is wrong (exit code 2).

    Raised, before the compile, by the config's own checks (flashrt_build/config/,
    without torch), by the preflight (stages/preflight.py: what needs torch), and
    by the stages that hold the module against its config (module.py,
    checkpoint.py, domain.py); by a command or `load` for a wrong argument (`kind`)."""

    exit_code = 2

    def __init__(self, key: str, value: object, expected: str, kind: str = "config key") -> None:
        """`kind` says what `key` is: a config key, a command's `argument`, an `environment variable`."""
        self.key, self.value, self.expected, self.kind = key, value, expected, kind
        super().__init__(f"{kind} '{key}' = {value!r}: {expected}")


class BuildError(FlashrtError):
    """A build stage failed on a valid config (exit code 1)."""


class InstantiateError(BuildError):
    """The module could not be constructed or its checkpoint not loaded."""


class ExportError(BuildError):
    """torch.export could not capture the whole module as one graph."""


class CompileError(BuildError):
    """AOTInductor failed to compile or package the exported graph."""


class VerifyError(BuildError):
    """The package disagrees with the eager module."""


class LoaderCrash(VerifyError):
    """The package killed or hung the process that loaded it."""


class WeightsMismatch(FlashrtError):
    """Weights given to a package differ from what it binds (names, shapes, dtypes, devices)."""

    def __init__(self, problems: dict[str, list[str]], source: str, hint: str = "") -> None:
        self.problems = problems
        listed = "; ".join(f"{kind}: {', '.join(names)}" for kind, names in problems.items())
        super().__init__(f"weights from {source} do not fit the package: {listed}{hint}")


class ArtifactError(FlashrtError):
    """A built artifact is missing, incomplete or altered since its build."""


class UnexpectedError(BuildError):
    """An error flashrt_build did not anticipate (a bug here or in a library):
    the build failed all the same, and says so in one line naming the cause."""

    def __init__(self, cause: BaseException) -> None:
        self.__cause__ = cause
        where = _innermost_frame(cause)
        super().__init__(f"{type(cause).__name__}: {first_lines(cause, 2)}{f' (at {where})' if where else ''}")


def _innermost_frame(exc: BaseException) -> str | None:
    """`file:line` where an exception was raised, for a one-line report."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}" if tb is not None else None


class Interrupted(BaseException):
    """SIGINT (Ctrl-C) or SIGTERM during a command: unwinds it like an error,
    so staging directories and locks are released on the way, but is no
    error of the build's (a BaseException: nothing catches it as one)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention: 130 for Ctrl-C, 143 for SIGTERM

    def __str__(self) -> str:
        name = signal.Signals(self.signum).name
        return f"interrupted by {name}: nothing was published; an earlier artifact at the output directory is as it was"


_received: list[int] = []  # the signal that stopped this command, once one has
_raised: list[bool] = []  # its `Interrupted` is on its way up
_deferring: list[bool] = []  # inside `cleanup_uninterrupted`: hold the signal until it ends


def stop_on_signals() -> None:
    """Turn the first SIGINT or SIGTERM into `Interrupted`; ignore later ones
    while the command cleans up."""

    def interrupt(signum: int, frame: object) -> None:
        for other in (signal.SIGINT, signal.SIGTERM):
            signal.signal(other, signal.SIG_IGN)
        _received.append(signum)
        if not _deferring:
            _raised.append(True)
            raise Interrupted(signum)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, interrupt)


def interrupted_instead(exc: BaseException) -> None:
    """Raise `Interrupted` in place of `exc` when a signal came first.

    Ctrl-C reaches the whole process group: a compiler or worker process can
    die of it and surface as an ordinary error before (or instead of) the
    signal's own `Interrupted`; the user interrupted the build all the same."""
    if _received and not isinstance(exc, Interrupted):
        raise Interrupted(_received[0]) from exc


@contextlib.contextmanager
def cleanup_uninterrupted() -> Iterator[None]:
    """Run a cleanup to its end even if a signal arrives during it (a
    half-removed staging directory is what the cleanup exists to prevent);
    the signal is raised as `Interrupted` once it is done."""
    _deferring.append(True)
    try:
        yield
    finally:
        _deferring.pop()
    if _received and not _raised and not _deferring:
        _raised.append(True)
        raise Interrupted(_received[0])


def exit_interrupted(stopped: Interrupted, report: Callable[[str], object]) -> NoReturn:
    """Report an interrupted command and end its process at once.

    The signal may have landed anywhere in torch (mid-compile, between a
    mode's push and its pop), and the frames it unwound keep that half-made
    state alive until the interpreter's teardown, which can abort on it (CI
    saw SIGABRT instead of exit 143). Staging directories, locks and partial
    files were undone while unwinding; only the output buffers are left."""
    report(str(stopped))
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed pipe: nobody is reading
            stream.flush()
    os._exit(stopped.exit_code)


def report_failure(log: logging.Logger, exc: Exception, what: str = "build failed") -> FlashrtError:
    """A failed build (or another command: `what` heads its traceback),
    however it was run (the command line, a sweep's build process):
    `Interrupted` instead when a signal came first; an exception raised on no
    purpose made an `UnexpectedError`; logged as one line. Returns the error,
    whose exit code is the command's."""
    interrupted_instead(exc)
    failure = exc if isinstance(exc, FlashrtError) else UnexpectedError(exc)
    log_failure(log, failure, what)
    return failure


def log_failure(log: logging.Logger, exc: BaseException, what: str = "build failed") -> None:
    """A failed build's one line (with its traceback when FLASHRT_TRACEBACK or
    HYDRA_FULL_ERROR is set), however the build was run."""
    if os.environ.get("FLASHRT_TRACEBACK") or os.environ.get("HYDRA_FULL_ERROR"):
        log.error(what, exc_info=exc.__cause__ if isinstance(exc, UnexpectedError) else exc)
    log.error("%s: %s", type(exc).__name__, exc)


def first_lines(exc: BaseException, n: int = 3) -> str:
    """The first `n` non-empty lines of an exception's message, on one line."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return " | ".join(lines[:n]) or type(exc).__name__


def command_verdict(check: Callable[[], dict[str, list[str]]], passed: str, failed: str) -> int:
    """Run a checking command's check and print its verdict: exit 0 and
    `passed` when it finds nothing; 1, `failed` and one line per finding
    (`  kind: item`) when it does; 2 and the reason when it could not check at
    all (not a build, an unreadable file, a wrong argument); a failed build
    (repro's rebuild) is 1."""
    try:
        findings = check()
    except (ArtifactError, ConfigError, OSError) as exc:
        print(f"error: cannot check: {exc}", file=sys.stderr)
        return 2
    except FlashrtError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    if not findings:
        print(passed)
        return 0
    print(failed)
    for kind, items in findings.items():
        for item in items:
            print(f"  {kind}: {item}")
    return 1


def quiet_known_warnings() -> None:
    """torch's own notices that are not the user's to act on: pytree
    deprecations on every export and torchao import, and "No CUDA runtime is
    found" on every CPU compile."""
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
    for name, notice in (
        ("torch.utils._pytree", "register_constant() on Enum subclasses is deprecated"),
        # torch's C++ extension helper, on every CPU compile of a CUDA build of torch on a machine without a GPU
        ("torch.utils.cpp_extension", "No CUDA runtime is found"),
    ):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Notice) and f.text == notice for f in logger.filters):
            logger.addFilter(_Notice(notice))


class _Notice(logging.Filter):
    """Drops one notice of a library's that is not the user's to act on."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()
