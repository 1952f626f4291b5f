"""Where the shipped configs live, and composing them without the CLI
(Hydra's composition errors said as the tool's one line: hydra_errors.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra import compose as hydra_compose
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf, open_dict

from ..errors import ConfigError
from .hydra_errors import composition_error, null_group
from .keys import unknown_keys, unread_module_keys, value_at
from .naming import group_overrides, names_nothing, variant_of
from .paths import check_config_dir
from .problems import raise_all
from .schema import BuildConfig, plain, register_schema
from .shipped import CONF_DIR
from .sources import check_allow_list_source, check_code_keys_source

__all__ = ["CONF_DIR", "as_build_config", "compose", "composition_error", "hydra_loader", "name_and_place"]


def as_build_config(cfg: DictConfig | BuildConfig | Mapping[str, Any]) -> DictConfig:
    """Merge any config-like value over the schema, so API callers get the
    same validation as the CLI."""
    if not isinstance(cfg, (Mapping, DictConfig, BuildConfig)):
        raise TypeError(
            f"cfg: expected a composed config (flashrt_build.compose([...])), a mapping of its keys or a module "
            f"object, got {type(cfg).__name__} {cfg!r}"
            + (f"; compose([{cfg!r}]) composes it" if isinstance(cfg, str) else "")
        )
    if isinstance(cfg, DictConfig) and OmegaConf.get_type(cfg) is BuildConfig:
        return cfg  # composed over the schema already (Hydra's defaults list names it)
    if isinstance(cfg, Mapping) and not isinstance(cfg, DictConfig):
        raise_all(unknown_keys(cfg))  # before the merge, whose message names no close key
    schema = OmegaConf.structured(BuildConfig)
    try:
        merged = OmegaConf.merge(schema, cfg)
    except Exception as exc:
        key = str(getattr(exc, "full_key", None) or "config")
        raise ConfigError(key, value_at(cfg, key, "?"), str(exc).splitlines()[0]) from None
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
    overrides: Sequence[str] = (),
    config_dir: str | Path | None = None,
    with_hydra: bool = False,
    config_name: str = "config",
) -> DictConfig:
    """The config the CLI would build for `overrides` (e.g. `["+module=mlp"]`),
    its output folder named as the CLI names it (`seed=1`: `...-seed_1`).

    `config_dir` adds a directory of the user's own configs to the search path,
    like the CLI's `--config-dir`; its parent joins `python_path`, so a module
    beside the configs imports. `with_hydra`: keep Hydra's own node
    (`hydra.*`: callbacks, logging, launcher), as the CLI composes it;
    `config_name`: the primary config (`--config-name`, one of `config_dir`'s).
    A mistake in the overrides or a config file is one ConfigError.
    """
    register_schema()
    given = list(overrides)
    if config_dir is not None:
        check_config_dir("config_dir", config_dir)
    if config_name != "config" and (config_dir is None or not (Path(config_dir) / f"{config_name}.yaml").is_file()):
        where = f"{config_dir} holds no {config_name}.yaml" if config_dir is not None else "no --config-dir is given"
        raise ConfigError("--config-name", config_name, f"{where}; a primary config of yours is a YAML file there",
                          "argument")  # fmt: skip
    if flags := [o for o in given if o.startswith("-")]:
        raise ConfigError("overrides", flags, "flags are the command line's; here config_dir= and config_name= say "
                          "them, and overrides are key=value", "argument")  # fmt: skip
    if not with_hydra and (run := [o for o in given if o.lstrip("+~").split("=")[0].split(".")[0] in ("hydra",)]):
        raise ConfigError("overrides", run, "hydra.* set Hydra's run, which composing without the command line has "
                          "none of: give them to flashrt-build", "argument")  # fmt: skip
    try:
        with hydra_loader(config_dir) as loader:
            cfg = hydra_compose(config_name=config_name, overrides=given, return_hydra_config=with_hydra)
            chosen = group_overrides(given, loader.get_group_options)
            # nothing the variant names set: the baseline is the config itself, no second compose
            baseline = cfg if names_nothing(given, chosen) else hydra_compose(config_name=config_name, overrides=chosen)
    except (ConfigCompositionException, MissingConfigException, OverrideParseException) as exc:
        raise composition_error(exc, given, config_dir) from None
    except ValueError as exc:  # `passes=null`: Hydra's own ValueError, before it composes anything
        if "Config group override must be" not in str(exc):
            raise
        raise null_group(given) from None
    if cfg.get("module") is not None:  # as composed, its interpolations unresolved: what reads what
        raise_all(unread_module_keys(plain(cfg.module)))
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
