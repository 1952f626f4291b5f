"""Where the shipped configs live, and composing them without the CLI."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import DictConfig

from .schema import register_schema

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def compose(overrides: Sequence[str] = (), config_dir: str | Path | None = None) -> DictConfig:
    """The config the CLI would build for `overrides` (e.g. `["+module=mlp"]`).

    `config_dir` adds a directory of the user's own configs to the search path,
    like the CLI's `--config-dir`.
    """
    register_schema()
    overrides = list(overrides)
    if config_dir is not None:
        overrides.append(f"hydra.searchpath=[file://{Path(config_dir).resolve()}]")
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides)
