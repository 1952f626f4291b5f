"""Keys the schema does not define, each named with the closest valid key:
Hydra's structured config refuses an unknown key on the command line without
`+` (compose.py words that refusal), but a key added with `+` (or given in a
plain mapping to the API) would be carried along and ignored."""

from __future__ import annotations

import dataclasses
import difflib
import enum
import re
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ..errors import ConfigError
from ..runtime.manifest import CAUSAL_LM_KEYS
from .schema import BuildConfig


def value_at(node: Any, key: str, missing: Any = None) -> Any:
    """The value at dotted `key` in nested mappings and lists (`module.files.0`), or `missing`."""
    for part in key.split("."):
        if isinstance(node, Sequence) and not isinstance(node, str) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, Mapping) and part in node:
            node = node[part]
        else:
            return missing
    return node


def unknown_keys(config: Mapping[str, Any]) -> list[ConfigError]:
    """Every key of `config` that the schema does not define, each naming its
    full dotted key, its value and the closest valid key. Free-form places
    (the module's constructor arguments, `module.kwargs`, Inductor's options)
    take any key."""
    problems: list[ConfigError] = []
    _walk(config, BuildConfig, [], problems)
    return problems


def removed_keys(config: Mapping[str, Any], node: Any = BuildConfig, path: str = "") -> list[ConfigError]:
    """Keys of the schema a composed config lacks: removed with `~KEY`, which
    the schema's every key must have (`~seed`: the build would fail on it)."""
    node = _unwrap_optional(node)
    if not dataclasses.is_dataclass(node) or not isinstance(config, Mapping):
        return []
    problems = []
    for name, kind in typing.get_type_hints(node).items():
        key = f"{path}{name}"
        if name not in config:
            problems.append(ConfigError(key, None, f"is a key every build has: set it ({key}=...), not remove it"))
        else:
            problems += removed_keys(config[name], kind, f"{key}.")
    return problems


def unread_module_keys(module: Mapping[str, Any]) -> list[ConfigError]:
    """causal_lm's keys set (not null) on a module whose config reads none of
    them through an interpolation (`+module=mlp module.batch=2`): they would
    change the build's folder and key and nothing else. `module` unresolved,
    as composed; a causal_lm config that dropped a method (and its reads of
    max_prompt) still takes them all, and a relative interpolation (`${..x}`),
    which could read any of them, leaves them be."""
    interpolations = [text for text in _texts({k: v for k, v in module.items() if k not in CAUSAL_LM_KEYS})
                      if "${" in text]  # fmt: skip
    if any("${." in text for text in interpolations) or any(
        re.search(rf"\bmodule\.{key}\b", text) for text in interpolations for key in CAUSAL_LM_KEYS
    ):
        return []
    return [
        ConfigError(f"module.{key}", module[key], "is a +module=causal_lm key; this module's config never reads it")
        for key in CAUSAL_LM_KEYS
        if module.get(key) is not None
    ]


def _texts(node: Any) -> Iterator[str]:
    """Every text value in nested mappings and lists."""
    if isinstance(node, str):
        yield node
    elif isinstance(node, Mapping):
        for value in node.values():
            yield from _texts(value)
    elif isinstance(node, Sequence):
        for value in node:
            yield from _texts(value)


def _walk(value: Any, node: Any, path: list[str], problems: list[ConfigError]) -> None:
    node = _unwrap_optional(node)
    if not isinstance(value, Mapping):
        return
    if dataclasses.is_dataclass(node):
        fields = typing.get_type_hints(node)
        for key, item in value.items():
            if key in fields:
                _walk(item, fields[key], [*path, str(key)], problems)
            else:
                problems.append(unknown_key(path, str(key), item))
    elif typing.get_origin(node) is dict:
        item_type = typing.get_args(node)[1]
        for key, item in value.items():
            _walk(item, item_type, [*path, str(key)], problems)


def unknown_key(path: list[str], key: str, value: Any, present: Sequence[str] = ()) -> ConfigError:
    """`path.key` is not a config key: say so, with the closest key that is.
    `present`: the keys the composed config holds at `path` (a free-form
    place's, `module.model`'s constructor arguments), nearer than the schema."""
    # `+inductr.options.max_autotune=true` arrives as {inductr: {options: {max_autotune: true}}}:
    # name the key as the user typed it.
    typed = [key]
    while isinstance(value, Mapping) and len(value) == 1:
        ((child, value),) = value.items()
        typed.append(str(child))
    guess = _closest(path, typed)
    if guess == [*path, *typed]:  # a free-form place (Inductor's options, a module's kwargs): new there
        new_key = ".".join(guess)
        close = difflib.get_close_matches(key, [str(k) for k in present], n=1)
        if close:  # a misspelling of what the config holds there (`chanels` for `channels`)
            return ConfigError(new_key, value, f"not in the config; did you mean {'.'.join([*path, close[0]])}?")
        return ConfigError(new_key, value, f"not in the config yet; a new key is added with '+': +{new_key}={value}")
    if not guess and not path:  # a group's key given without its group (`pretrained=DIR`)
        guess = _nested(key)
    if guess:
        hint = f"did you mean {'.'.join(guess)}?"
    else:
        siblings = sorted(typing.get_type_hints(_node_at(path)))
        hint = f"valid keys{' under ' + '.'.join(path) if path else ''}: {', '.join(siblings)}"
    return ConfigError(".".join([*path, *typed]), value, f"not a config key; {hint}")


def below_a_value(key: str, value: Any) -> ConfigError | None:
    """`weights.path=x`: a key below one that holds a single value (a choice,
    a number, a string) has nowhere to go; say what that value is, where
    OmegaConf says 'Value {} (dict) is not a valid input for WeightsMode'."""
    parts = key.split(".")
    node: Any = BuildConfig
    for at, part in enumerate(parts[:-1]):
        node = _unwrap_optional(node)
        if dataclasses.is_dataclass(node):
            node = typing.get_type_hints(node).get(part)
        elif typing.get_origin(node) is dict:
            node = typing.get_args(node)[1]
        else:
            return None
        held = _unwrap_optional(node)
        if held is None or held is Any or dataclasses.is_dataclass(held) or typing.get_origin(held) is not None:
            continue  # keys below it, or free-form: not this mistake
        parent = ".".join(parts[: at + 1])
        choices: list[enum.Enum] = list(held) if isinstance(held, enum.EnumMeta) else []
        what = f"one of {', '.join(str(choice.value) for choice in choices)}" if choices else held.__name__
        return ConfigError(key, value, f"{parent} holds a value ({what}), not keys: set it with {parent}=...")
    return None


def _closest(path: list[str], typed: list[str]) -> list[str] | None:
    """The valid key nearest to `path + typed`: each unknown part replaced by
    its closest sibling, free-form parts kept; None when the first unknown part
    resembles nothing."""
    node: Any = BuildConfig
    guess: list[str] = []
    for part in [*path, *typed]:
        node = _unwrap_optional(node)
        if dataclasses.is_dataclass(node):
            fields = typing.get_type_hints(node)
            match = part if part in fields else next(iter(difflib.get_close_matches(part, fields, n=1)), None)
            if match is None:
                return guess if len(guess) > len(path) else None
            guess.append(match)
            node = fields[match]
        elif typing.get_origin(node) is dict:
            guess.append(part)
            node = typing.get_args(node)[1]
        else:  # free-form from here on
            guess.append(part)
    return guess


def _nested(key: str) -> list[str] | None:
    """The key of a top-level group named like `key` (`module.pretrained` for `pretrained`)."""
    for group, node in typing.get_type_hints(BuildConfig).items():
        node = _unwrap_optional(node)
        if dataclasses.is_dataclass(node) and key in typing.get_type_hints(node):
            return [group, key]
    return None


def _node_at(path: list[str]) -> Any:
    node: Any = BuildConfig
    for part in path:
        node = _unwrap_optional(node)
        node = typing.get_type_hints(node)[part] if dataclasses.is_dataclass(node) else typing.get_args(node)[1]
    return _unwrap_optional(node)


def _unwrap_optional(node: Any) -> Any:
    """`X | None` is `X` here: a None value has no keys to check."""
    if typing.get_origin(node) in (typing.Union, types.UnionType):
        options = [arg for arg in typing.get_args(node) if arg is not type(None)]
        return options[0] if len(options) == 1 else Any
    return node
