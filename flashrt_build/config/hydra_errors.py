"""A composition error of Hydra's (a missing config, an override its
grammar cannot read, a key the schema does not have, a value of the wrong
type), said as the tool's one line: the key, its value as the command line
or the config file gave it, and what was expected."""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.errors import MissingConfigException, OverrideParseException
from omegaconf import DictConfig

from ..errors import ConfigError, first_lines
from .keys import below_a_value, unknown_key
from .shipped import CONF_DIR

__all__ = ["composition_error", "null_group"]


# Names people use for a shipped option, where spelling alone would suggest
# another (`target=gpu` is nearest to cpu).
_OTHER_NAMES = {("target", "gpu"): "cuda", ("target", "nvidia"): "cuda"}


def composition_error(
    exc: Exception, overrides: Sequence[str] = (), config_dir: str | Path | None = None
) -> ConfigError:
    """Hydra's multi-line composition error as the tool's one line: the key
    (or config group) and its value (as the command line or the config file
    that set it gave it), and what was expected."""
    values = {_override_key(o): o.partition("=")[2] for o in overrides if "=" in o}
    if isinstance(exc, MissingConfigException) and exc.missing_cfg_file and exc.options is not None:
        group, _, option = exc.missing_cfg_file.rpartition("/")
        other = _OTHER_NAMES.get((group, option.lower()))
        close = [other] if other in exc.options else difflib.get_close_matches(option, exc.options, n=1)
        hint = f"; did you mean {close[0]}?" if close else _config_dir_hint(group, option)
        return ConfigError(
            group, option, f"no such {group} config; choices: {', '.join(exc.options)}{hint}", "config group"
        )
    if isinstance(exc, OverrideParseException):
        wrong = next((o for o in overrides if o in str(exc)), None)
        if wrong is None:
            return ConfigError("command line", " ".join(overrides), first_lines(exc, 1), "argument")
        key, _, value = wrong.partition("=")
        return ConfigError(
            key.lstrip("+~"),
            value,
            f"Hydra's override grammar cannot read {wrong!r}; quote a value with special characters: {key}='{value}'",
        )
    cause = exc.__cause__ or exc.__context__
    full_key = getattr(cause, "full_key", None)
    text = str(exc)
    merging = re.match(r"Error merging override (\S+?)=", text)
    axis = _axis_override(values, merging.group(1).lstrip("+~") if merging else str(full_key or ""))
    if axis is not None:
        return axis
    where = text[len("In '") : text.index("'", 4)] if text.startswith("In '") else None
    in_file = f" (in {where}.yaml)" if where else ""
    if where and full_key and str(full_key) not in values:  # set by that file: its value, not '?'
        values[str(full_key)] = _file_value(where, str(full_key), config_dir)
    if full_key and type(cause).__name__ in ("ConfigAttributeError", "ConfigKeyError"):
        *path, key = str(full_key).split(".")
        parent = getattr(cause, "parent_node", None)  # the composed node the key was missing from
        present = [str(k) for k in parent] if isinstance(parent, DictConfig) else []
        problem = unknown_key(path, key, _typed_value(str(full_key), values), present)
        return ConfigError(problem.key, problem.value, problem.expected + in_file)
    if merging:  # the override's own key: a merge error's full_key may be relative to the node it hit
        full_key = merging.group(1).lstrip("+~")
    if full_key:
        scalar = below_a_value(str(full_key), values.get(str(full_key), "?"))
        if scalar is not None:
            return scalar
        why = first_lines(cause, 1) if cause is not None else text
        return ConfigError(str(full_key), values.get(str(full_key), "?"), f"{why}{in_file}")
    if "An item is already at" in text:
        key = text.split("'")[1]
        return ConfigError(f"+{key}", values.get(key, "?"), f"is already a config key: write {key}=... without '+'")
    known = _said_plainly(text, values)
    if known is not None:
        return known
    return ConfigError("command line", " ".join(overrides), first_lines(exc, 2), "argument")


def _file_value(where: str, full_key: str, config_dir: str | Path | None) -> Any:
    """The value config file `where` (`passes/fast`) gives `full_key`: under
    its group's package or, `# @package _global_`, at the top; '?' where the
    file cannot be found or read."""
    from omegaconf import OmegaConf

    group = where.partition("/")[0]
    for folder in [*([Path(config_dir)] if config_dir is not None else []), CONF_DIR]:
        file = folder / f"{where}.yaml"
        if not file.is_file():
            continue
        try:
            data = OmegaConf.load(file)
            for key in (full_key.removeprefix(f"{group}."), full_key):
                value = OmegaConf.select(data, key, default=_ABSENT, throw_on_missing=False)
                if value is not _ABSENT:
                    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
        except Exception:  # noqa: BLE001 - a value to show, never a second error
            return "?"
    return "?"


_ABSENT = object()


def null_group(overrides: Sequence[str]) -> ConfigError:
    """`GROUP=null` (or `~`-less `GROUP=`): a group takes a config's name."""
    wrong = next((o for o in overrides if o.partition("=")[2] in ("null", "")), " ".join(overrides))
    group = _override_key(wrong)
    shipped = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml")) if group.isidentifier() else []
    choices = f" (shipped: {', '.join(shipped)})" if shipped else ""
    return ConfigError(
        group, None, f"a config group takes the name of one of its configs{choices}, not null", "config group"
    )


def _said_plainly(text: str, values: dict[str, str]) -> ConfigError | None:
    """Hydra's messages about groups and values, in the command line's words."""
    multiple = re.match(r"Multiple values for (\S+?)\. To override a value use 'override \S+: (.*)'", text)
    if multiple:  # Hydra's advice is the defaults list's YAML; on a command line it is GROUP=NAME
        group, option = multiple.groups()
        return ConfigError(
            f"+{group}", option, f"{group} already has a config: write {group}={option} without '+'", "config group"
        )
    if "No match in the defaults list" in text:
        group = text.split("'")[1]
        return ConfigError(group, values.get(group, "?"), f"add a {group} with +{group}=NAME", "config group")
    if text.startswith("Ambiguous value for argument"):
        key, _, value = text.split("'")[1].partition("=")
        return ConfigError(
            key.lstrip("+~"),
            value,
            f"several values sweep only with -m (--multirun); a list is {key}=[{value}], a string {key}='{value}'",
        )
    return None


def _config_dir_hint(group: str, option: str) -> str:
    """Where a config of that name lies near the working directory, for a
    command line that did not name its directory (`--config-dir my_conf`)."""
    here = Path.cwd()
    for found in sorted([*here.glob(f"{group}/{option}.yaml"), *here.glob(f"*/{group}/{option}.yaml")]):
        folder = found.parent.parent.relative_to(here)
        return f"; {found.relative_to(here)} is one: add --config-dir {folder}"
    return ""


# `module.inputs.x.dynamic.0.max`: an axis named in a dotted key
_AXIS_KEY = re.compile(r"(?P<whole>(?:.+\.)?dynamic)\.(?P<axis>\d+)(?:\.(?P<rest>.+))?")


def _axis_override(values: dict[str, str], failed: str) -> ConfigError | None:
    """A dotted key through an axis number finds nothing: Hydra reads the 0
    of `dynamic.0.max` as text, the YAML's `0:` is a number. A mapping merged
    over `dynamic` reaches it (and adds a new axis), so say that one."""
    for key, value in values.items():
        match = _AXIS_KEY.fullmatch(key)
        if match is None or not failed or not (key == failed or key.startswith(f"{failed}.")):
            continue
        inner = value
        for part in reversed(match["rest"].split(".") if match["rest"] else []):
            inner = f"{{{part}: {inner}}}"
        whole = f"++{match['whole']}={{{match['axis']}: {inner}}}"
        return ConfigError(
            key, value, f"a dotted key cannot reach an axis (Hydra reads {match['axis']} as text); merge it: '{whole}'"
        )
    return None


def _typed_value(full_key: str, values: dict[str, str]) -> Any:
    """The value the command line gave `full_key`, or gave a key below it
    (`inductor.option.max_autotune=true` fails at `inductor.option`) nested
    as {max_autotune: 'true'}, so the message names the key as typed."""
    typed = next((key for key in values if key.startswith(f"{full_key}.")), None)
    if full_key in values or typed is None:
        return values.get(full_key, "?")
    value: Any = values[typed]
    for part in reversed(typed[len(full_key) + 1 :].split(".")):
        value = {part: value}
    return value


def _override_key(override: str) -> str:
    return override.partition("=")[0].lstrip("+~")
