"""The command line, checked before Hydra acts on it. Hydra runs code of its
own before the build's first line (callbacks, logging handlers, a launcher's
setup) and words its composition errors for its own users; so the tool
composes each job's config first, as Hydra will: a typo, a missing config or
an unparsable override is one line naming the key and what was expected,
and under an allow-list (`release=true`, `allowed_targets`) nothing Hydra
would run that the list does not admit gets the chance to run."""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ..artifact import enclosing_build
from ..errors import ConfigError
from .compose import CONF_DIR, compose, hydra_loader
from .hydra_errors import composition_error
from .paths import check_config_dir, derive_output_dir
from .problems import raise_all
from .schema import plain
from .targets import allowed_targets, hydra_code_problems

# Hydra's flags that take a value; argparse takes no override after one
# (`-m +module=x --config-dir d seed=1,2` was its 9-line usage).
_VALUED_FLAGS = ("--config-dir", "-cd", "--config-name", "-cn", "--config-path", "-cp")


def flags_first(argv: Sequence[str]) -> list[str]:
    """`argv` with Hydra's valued flags (and their values) before the
    overrides, wherever they were given."""
    flags, rest = [], []
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg in _VALUED_FLAGS and args:
            flags += [arg, args.pop(0)]
        elif arg.split("=", 1)[0] in _VALUED_FLAGS and arg.startswith("--"):
            flags.append(arg)
        else:
            rest.append(arg)
    return flags + rest


def check_command_line(argv: Sequence[str]) -> DictConfig | None:
    """Raise a ConfigError for what Hydra would refuse, or run unchecked. A
    plain run's config (Hydra's node too) comes back: what Hydra would
    compose for it, which may answer before Hydra starts (an up-to-date
    build); None for a sweep, Hydra's own pages or a `--cfg` print."""
    from hydra._internal.utils import get_args_parser

    args, _ = get_args_parser().parse_known_args(list(argv))
    if args.config_dir is not None:
        check_config_dir("--config-dir", args.config_dir, own_primary=args.config_name is not None)
    if args.config_path:  # Hydra's primary search path: it would replace the tool's own configs
        raise ConfigError("--config-path", args.config_path, "replaces the tool's own config directory; give your "
                          "configs with --config-dir DIR (and a primary config of yours with --config-name NAME)",
                          "argument")  # fmt: skip
    if args.help or args.hydra_help or args.info or args.shell_completion:
        return None  # Hydra's own pages
    overrides = list(args.overrides)
    jobs = sweep_jobs(overrides, args.config_dir) if args.multirun else [overrides]
    places: dict[Path, int] = {}  # each job's output directory: two jobs of a sweep never share one
    cfg = None
    for number, job in enumerate(jobs, 1):
        try:
            cfg = compose(job, config_dir=args.config_dir, with_hydra=True, config_name=args.config_name or "config")
            check_logs_dir(cfg, "hydra.sweep.dir" if args.multirun else "hydra.run.dir")
            config = plain(cfg)
            patterns = allowed_targets(config)
            if patterns:
                raise_all(hydra_code_problems(config["hydra"], patterns, job, shipped_setup_lines()))
            if len(jobs) > 1:
                place = output_dir_of(cfg)
                if place is not None and place in places:
                    raise ConfigError(
                        "output_dir",
                        str(place),
                        f"is also sweep job {places[place]}'s: the later build would replace the earlier one; tell "
                        "them apart with module.name=... (or output_dir=...) per job",
                    )
                if place is not None:
                    places[place] = number
        except ConfigError as exc:
            if len(jobs) == 1:
                raise
            where = f" (sweep job {number} of {len(jobs)}: {' '.join(job)})"
            raise ConfigError(exc.key, exc.value, exc.expected + where, exc.kind) from None
    plain_run = not args.multirun and args.cfg is None and getattr(args, "experimental_rerun", None) is None
    plain_run = plain_run and args.config_name is None  # a primary config of the user's: Hydra runs it
    return cfg if plain_run else None


def check_logs_dir(cfg: Any, key: str) -> None:
    """Hydra makes its run (or sweep) directory before the build's first
    line: one inside a build's artifact would leave that artifact holding
    entries its build did not write, which then refuses to serve."""
    try:
        place = OmegaConf.select(cfg, key, throw_on_missing=True)
    except Exception:  # an interpolation that cannot be said yet: Hydra's to make
        return
    inside = enclosing_build(Path(str(place)) / ".hydra") if place else None
    if inside is not None:
        raise ConfigError(key, str(place), f"is inside {inside}, a build's artifact, which would then refuse to serve "
                          "(Hydra writes its logs there first): give a directory outside it")  # fmt: skip


def output_dir_of(cfg: Any) -> Path | None:
    """Where a composed job's build goes (as resolve_spec derives it); None
    where that cannot be said yet (the build will say why)."""
    keys = ["output_root", "output_dir", "variant", "weights", "module.name", "target.name", "inductor.name",
            "quant.name", "passes.name"]  # fmt: skip
    try:
        values = {key: OmegaConf.select(cfg, key, throw_on_missing=True) for key in keys}
        values = {key: value.value if isinstance(value, Enum) else value for key, value in values.items()}
    except Exception:  # an interpolation that fails: the job's own check names it
        return None
    config: dict[str, Any] = {}
    for key, value in values.items():
        group, _, name = key.rpartition(".")
        (config.setdefault(group, {}) if group else config)[name or key] = value
    try:
        return derive_output_dir(config, Path.cwd())
    except ConfigError:
        return None


def sweep_jobs(overrides: list[str], config_dir: str | None = None) -> list[list[str]]:
    """Each job's overrides, as Hydra's basic sweeper splits a multirun
    (`glob(*_tiny)` reads the config groups: the config dir's too)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException, OverrideParseException

    try:
        with hydra_loader(config_dir) as loader:
            parsed = OverridesParser.create(config_loader=loader).parse_overrides(overrides)
            _check_sweep_level(loader, parsed, overrides)
            return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]
    except (OverrideParseException, HydraException) as exc:
        raise composition_error(exc, overrides) from None


def _check_sweep_level(loader: Any, parsed: list[Any], overrides: list[str]) -> None:
    """Hydra composes a sweep once before it splits it, with a swept group
    (`+module=a,b`) not yet chosen: a key inside that group
    (`module.max_prompt=4`) then has nothing to go into, and Hydra fails with a
    traceback. Said as the override to blame."""
    from hydra.types import RunMode

    swept = {o.key_or_group for o in parsed if o.is_sweep_override() and "." not in o.key_or_group}
    inside = [o for o in parsed if o.key_or_group.split(".")[0] in swept and "." in o.key_or_group]
    if not inside:
        return
    try:
        loader.load_configuration("config", overrides, RunMode.MULTIRUN)
    except AssertionError:
        group = inside[0].key_or_group.split(".")[0]
        raise ConfigError(
            inside[0].key_or_group,
            inside[0].value(),
            f"is inside the config group '{group}', which this sweep chooses: Hydra composes the sweep before any "
            f"{group} is chosen, so the key has nothing to go into; set it in each {group} file, or sweep "
            f"one {group} at a time",
        ) from None


def shipped_setup_lines() -> list[str]:
    """The shell lines the shipped launcher configs run before a build (SLURM's `setup`)."""
    lines: list[str] = []
    for path in sorted((Path(CONF_DIR) / "hydra" / "launcher").glob("*.yaml")):
        lines += plain(OmegaConf.load(path)).get("setup") or []
    return lines
