"""Where the shipped configs live, and composing them without the CLI."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from ..errors import ConfigError, raise_all
from .paths import check_config_dir
from .schema import BuildConfig, register_schema, unknown_keys

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


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


def compose(overrides: Sequence[str] = (), config_dir: str | Path | None = None) -> DictConfig:
    """The config the CLI would build for `overrides` (e.g. `["+module=mlp"]`).

    `config_dir` adds a directory of the user's own configs to the search path,
    like the CLI's `--config-dir`.
    """
    register_schema()
    overrides = list(overrides)
    if config_dir is not None:
        check_config_dir("config_dir", config_dir)
        overrides.append(f"hydra.searchpath=[file://{Path(config_dir).resolve()}]")
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides)
