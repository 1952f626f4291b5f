"""Under an allow-list (`release=true`, `allowed_targets`), where a value
came from: the command line (the user's word) or a config file (which the
list judges). A config file may not widen the list, nor set what chooses
code the list does not judge (`python_path`, `toolchain.cxx`, an Inductor
option that may name code); the command line may."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import ConfigError
from .targets import allowed_targets


def command_line_value(overrides: Sequence[str], key: str) -> tuple[bool, Any]:
    """(given, value) of `key` among command-line overrides, parsed as Hydra parses them."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    for override in reversed(OverridesParser.create().parse_overrides(list(overrides))):
        if override.key_or_group == key and not override.is_delete():
            value = override.value()
            return True, list(value) if isinstance(value, list) else value
    return False, None


def command_line_gives(overrides: Sequence[str], key: str, value: Any) -> bool:
    """Whether an override gives dotted `key` this `value`: the key itself,
    or a node holding it whose given mapping holds it (`inductor.options={}`
    merges into the file's options, so it gives none of them)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from .compiler import flatten_options

    for override in OverridesParser.create().parse_overrides(list(overrides)):
        given, node = override.key_or_group, None if override.is_delete() else override.value()
        if given == key and node == value:
            return True
        if key.startswith(f"{given}.") and isinstance(node, Mapping):
            found = flatten_options(node).get(key.removeprefix(f"{given}."), _NOT_GIVEN)
            if found == value:
                return True
    return False


_NOT_GIVEN = object()


def check_allow_list_source(composed: Any, overrides: Sequence[str]) -> None:
    """The allow-list judges the config files, so none of them may set it:
    only the command line (or the API's overrides). A module file with
    `# @package _global_` that widened it would admit the code it names."""
    given, value = command_line_value(overrides, "allowed_targets")
    if given and (not isinstance(value, list) or not all(isinstance(v, str) for v in value)):
        raise ConfigError("allowed_targets", value, "expected a list of fnmatch patterns (strings): [mymodels.*]")
    expected = value if given else []
    found = [] if composed is None else composed
    if found != expected:
        raise ConfigError(
            "allowed_targets",
            found,
            "set by a config file, which the allow-list judges: a config cannot widen the list that admits "
            "its own code; set allowed_targets=[...] on the command line (or in compose()'s overrides)",
        )


# Keys that choose code besides `_target_`s: where modules import from, which
# compiler runs. Under an allow-list only the command line may set them.
CODE_KEYS: dict[str, Any] = {"python_path": [], "toolchain.cxx": None}


def check_code_keys_source(config: Mapping[str, Any], overrides: Sequence[str]) -> None:
    """Under an allow-list (release=true, allowed_targets), `python_path`,
    `toolchain.cxx` and the Inductor options that may name code (compiler.code_options)
    from a config file would run code the list never judges (a package of
    the user's shadowing a shipped one, a compiler that is a script):
    refused unless the command line sets them."""
    from .compiler import code_options, inductor_option_sets
    from .keys import value_at

    if not allowed_targets(config):
        return
    for where, options in inductor_option_sets(config):
        for name in code_options(options):
            if not command_line_gives(overrides, f"{where}.{name}", options[name]):
                raise ConfigError(
                    f"{where}.{name}",
                    options[name],
                    "set by a config file under an allow-list (release=true or allowed_targets): a value that may "
                    "name code Inductor runs (a path, a compiler flag), which the list does not judge; set it on the "
                    "command line if you mean it",
                )
    for key, default in CODE_KEYS.items():
        value = value_at(config, key)
        if value in (default, None) or command_line_value(overrides, key)[0]:
            continue
        raise ConfigError(
            key,
            value,
            "set by a config file under an allow-list (release=true or allowed_targets): it chooses code the list "
            f"does not judge; set {key}=... on the command line if you mean it",
        )
