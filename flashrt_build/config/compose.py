"""Where the shipped configs live, and composing them without the CLI; a
composition error of Hydra's, said as the tool's one line."""

from __future__ import annotations

import contextlib
import difflib
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra import compose as hydra_compose
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf, open_dict

from ..errors import ConfigError, first_lines
from .keys import below_a_value, unknown_key, unknown_keys
from .naming import group_overrides, variant_of
from .paths import check_config_dir
from .problems import raise_all
from .schema import BuildConfig, plain, register_schema
from .shipped import CONF_DIR
from .targets import check_allow_list_source, check_code_keys_source

__all__ = ["CONF_DIR", "as_build_config", "compose", "composition_error", "hydra_loader", "name_and_place"]


def as_build_config(cfg: DictConfig | BuildConfig | Mapping[str, Any]) -> DictConfig:
    """Merge any config-like value over the schema, so API callers get the
    same validation as the CLI."""
    if isinstance(cfg, Mapping) and not isinstance(cfg, DictConfig):
        raise_all(unknown_keys(cfg))  # before the merge, whose message names no close key
    schema = OmegaConf.structured(BuildConfig)
    try:
        merged = OmegaConf.merge(schema, cfg)
    except Exception as exc:
        raise ConfigError(getattr(exc, "full_key", "config"), "?", str(exc).splitlines()[0]) from None
    assert isinstance(merged, DictConfig)
    return merged


# Where a `--config-dir` goes in Hydra's search path: before the shipped
# configs (Hydra's own place for it is after them), so a user's module/mlp.yaml
# is the one composed, as the README promises.
USER_FIRST = "main"


@contextlib.contextmanager
def users_configs_first() -> Iterator[None]:
    """The command line's `--config-dir` searched before the shipped configs,
    as `hydra_loader` searches it: Hydra anchors it after them."""
    from hydra._internal.config_search_path_impl import ConfigSearchPathImpl

    prepend = ConfigSearchPathImpl.prepend

    def user_first(self: Any, provider: str, path: str, anchor: Any = None) -> None:
        prepend(self, provider, path, USER_FIRST if provider == "command-line" else anchor)

    ConfigSearchPathImpl.prepend = user_first  # type: ignore[method-assign]
    try:
        yield
    finally:
        ConfigSearchPathImpl.prepend = prepend  # type: ignore[method-assign]


@contextlib.contextmanager
def hydra_loader(config_dir: str | Path | None = None) -> Iterator[Any]:
    """Hydra set up as the command line sets it up: the shipped configs, and
    `config_dir`'s before the schema (as `--config-dir` adds them); yields its
    config loader. Hydra's global state is as it was afterwards."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.initialize import get_gh_backup, restore_gh_from_backup

    search = create_config_search_path(str(CONF_DIR))
    if config_dir is not None:
        search.prepend(provider="command-line", path=f"file://{Path(config_dir).resolve()}", anchor=USER_FIRST)
    backup = get_gh_backup()
    GlobalHydra.instance().clear()
    try:
        Hydra.create_main_hydra2(task_name="flashrt_build", config_search_path=search)
        yield GlobalHydra.instance().config_loader()
    finally:
        restore_gh_from_backup(backup)


def compose(
    overrides: Sequence[str] = (), config_dir: str | Path | None = None, with_hydra: bool = False
) -> DictConfig:
    """The config the CLI would build for `overrides` (e.g. `["+module=mlp"]`),
    its output folder named as the CLI names it (`seed=1`: `...-seed_1`).

    `config_dir` adds a directory of the user's own configs to the search path,
    like the CLI's `--config-dir`; its parent joins `python_path`, so a module
    beside the configs imports. `with_hydra`: keep Hydra's own node
    (`hydra.*`: callbacks, logging, launcher), as the CLI composes it.
    A mistake in the overrides or a config file is one ConfigError.
    """
    register_schema()
    given = list(overrides)
    if config_dir is not None:
        check_config_dir("config_dir", config_dir)
    try:
        with hydra_loader(config_dir) as loader:
            cfg = hydra_compose(config_name="config", overrides=given, return_hydra_config=with_hydra)
            chosen = group_overrides(given, loader.get_group_options)
            # only config files chosen: the baseline is the config itself, no second compose
            baseline = cfg if chosen == given else hydra_compose(config_name="config", overrides=chosen)
    except (ConfigCompositionException, MissingConfigException, OverrideParseException) as exc:
        raise composition_error(exc, given, config_dir) from None
    except ValueError as exc:  # `passes=null`: Hydra's own ValueError, before it composes anything
        if "Config group override must be" not in str(exc):
            raise
        raise _null_group(given) from None
    check_allow_list_source(plain(cfg).get("allowed_targets"), given)
    check_code_keys_source(plain(cfg), given)  # before the config dir's parent joins python_path
    name_and_place(cfg, baseline, config_dir)
    return cfg


@dataclass(frozen=True)
class Naming:
    """What names a command line's output folder beyond its config: the same
    config from its config-file choices alone (the variant is where the two
    differ) and the `--config-dir` it was given."""

    baseline: DictConfig
    config_dir: str | Path | None = None


def name_and_place(cfg: DictConfig, baseline: DictConfig, config_dir: str | Path | None) -> None:
    """Set what composing decides beyond the configs' own values: the output
    folder's variant (where `cfg` differs from the chosen configs alone), and
    the config dir's parent on `python_path`."""
    with open_dict(cfg):
        if cfg.get("variant") is None:
            cfg.variant = variant_of(plain(cfg), plain(baseline))
        if config_dir is not None:
            parent = str(Path(config_dir).resolve().parent)
            if parent not in (cfg.get("python_path") or []):
                cfg.python_path = [*(cfg.get("python_path") or []), parent]


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


def _null_group(overrides: Sequence[str]) -> ConfigError:
    """`GROUP=null` (or `~`-less `GROUP=`): a group takes a config's name."""
    wrong = next((o for o in overrides if o.partition("=")[2] in ("null", "")), " ".join(overrides))
    group = _override_key(wrong)
    shipped = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml")) if group.isidentifier() else []
    choices = f" (shipped: {', '.join(shipped)})" if shipped else ""
    return ConfigError(
        group, None, f"a config group takes the name of one of its configs{choices}, not null", "config group"
    )


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
