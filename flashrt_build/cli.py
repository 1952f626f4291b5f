"""The command line: a thin Hydra shell over `flashrt_build.build`.

Exit codes: 0 built or up to date; 1 a build failed; 2 the config or the
command line is wrong. Errors print as one line; set FLASHRT_TRACEBACK=1 (or
HYDRA_FULL_ERROR=1) for the traceback.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

from .config import CONF_DIR
from .schema import register_schema

log = logging.getLogger("flashrt_build")

# Overrides that pick a group or say where to build; any other override makes
# a variant that gets its own output directory.
_NAMING_KEYS = {"module", "target", "inductor", "weights", "output_root", "output_dir", "variant", "verify", "force"}

# Exit codes of the jobs this process ran (one in a run, several in a sweep).
_job_codes: list[int] = []


def variant_of(overrides: list[str]) -> str | None:
    """A directory-safe suffix from overrides that are not group choices."""
    parts = []
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if key in _NAMING_KEYS or key.split(".")[0] in ("verify", "hydra"):
            continue
        if key == "module.checkpoint":  # the file's stem says which checkpoint, not its path
            key, value = "ckpt", Path(value).stem
        parts.append(re.sub(r"[^A-Za-z0-9_.=-]+", "_", f"{key}={value}"))
    return ",".join(parts).replace("=", "_").replace(",", "-") or None


def run_job(cfg: DictConfig) -> int:
    """Build one config; return its exit code instead of raising."""
    from .errors import FlashrtError

    if cfg.get("variant") is None and HydraConfig.initialized():
        with open_dict(cfg):
            cfg.variant = variant_of(list(HydraConfig.get().overrides.task))
    try:
        if up_to_date(cfg):
            return 0
        from .pipeline import build  # torch is imported only when there is work to do

        build(cfg)
        return 0
    except FlashrtError as exc:
        if os.environ.get("FLASHRT_TRACEBACK") or os.environ.get("HYDRA_FULL_ERROR"):
            log.exception("build failed")
        log.error("%s: %s", type(exc).__name__, exc)
        return exc.exit_code


def up_to_date(cfg: DictConfig) -> bool:
    """Decide, without importing torch, that no build is needed (the artifact
    in place is current, or an identical one is in the store)."""
    from .cache import reuse
    from .config import as_build_config
    from .key import build_keys, key_ingredients
    from .spec import resolve_spec

    spec = resolve_spec(as_build_config(cfg))
    if spec.force or spec.device.startswith("cuda"):  # a GPU's identity needs torch: the full path checks
        return False
    ingredients = key_ingredients(spec)
    return reuse(spec, build_keys(ingredients), ingredients, say_why=False) is not None


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    _job_codes.append(run_job(cfg))


def main() -> None:
    """Console entry point (`flashrt-build`, `python -m flashrt_build`)."""
    register_schema()
    # torch's own pytree deprecation notice, printed on every export: not the user's to act on
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
    try:
        _hydra_main()
    except SystemExit as exc:
        # Hydra exits 1 on any composition error (unknown key, wrong type,
        # missing group option): that is the command line's fault, so exit 2.
        if exc.code not in (0, None) and not _job_codes:
            sys.exit(2)
        raise
    sys.exit(max(_job_codes, default=0))
