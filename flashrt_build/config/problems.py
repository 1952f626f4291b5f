"""The one collector of config problems, so every problem of a config is
reported at once: the resolvers here and the preflight (stages/) add to it,
`check` runs a check that raises, `raise_all` reports them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import ConfigError

T = TypeVar("T")


def raise_all(problems: list[ConfigError]) -> None:
    """Raise the one problem found, or all of them together."""
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise ConfigErrors(problems)


class Problems(list[ConfigError]):
    """Config problems collected, to be raised together."""

    def check(self, fn: Callable[..., T], *args: Any) -> T | None:
        """`fn(*args)`, or None with its problems collected."""
        try:
            return fn(*args)
        except ConfigErrors as exc:
            self.extend(exc.problems)
        except ConfigError as exc:
            self.append(exc)
        return None

    def raise_all(self) -> None:
        raise_all(self)


class ConfigErrors(ConfigError):
    """Several config problems, reported together (exit code 2)."""

    def __init__(self, problems: list[ConfigError]) -> None:
        self.problems = problems
        self.key, self.value, self.expected = problems[0].key, problems[0].value, problems[0].expected
        self.kind = problems[0].kind
        lines = "\n".join(f"  - {p}" for p in problems)
        Exception.__init__(self, f"the config has {len(problems)} errors:\n{lines}")
