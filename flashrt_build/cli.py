"""The command line: a thin Hydra shell over `flashrt_build.build`.

Exit codes: 0 built or up to date; 1 a build failed; 2 the config or the
command line is wrong. Errors print as one line; set FLASHRT_TRACEBACK=1 (or
HYDRA_FULL_ERROR=1) for the traceback.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, cast

import hydra
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from .artifact import enclosing_build
from .config.command_line import check_command_line, flags_first
from .config.compose import CONF_DIR, Naming, users_configs_first
from .config.inputs import is_name
from .config.naming import group_overrides, names_nothing
from .config.paths import check_writable
from .config.schema import register_schema
from .errors import ConfigError, Interrupted, exit_interrupted, quiet_known_warnings, stop_on_signals
from .stages.threads import default_parallel_jobs

log = logging.getLogger("flashrt_build")


# Exit codes of the jobs this process ran (one in a run, several in a sweep).
_job_codes: list[int] = []


def logs_root(output_root: str) -> str:
    """Where Hydra keeps a command's logs (`.runs/`, `.sweeps/`): the output
    root, or a temporary directory when the output root cannot be written, so
    the build refuses `output_root` by name instead of Hydra failing to mkdir
    (or inside a build's artifact, which the build refuses too)."""
    root = Path(output_root).expanduser()
    elsewhere = str(Path(tempfile.gettempdir()) / "flashrt_build-logs")
    if enclosing_build(root.resolve() / ".runs") is not None:  # an artifact with logs in it would stop serving
        return elsewhere
    try:
        check_writable(root.resolve(), "output_root", beside=False)
    except ConfigError:
        return elsewhere
    return str(root)


def logs_name(name: object) -> str:
    """The module's name as a folder of Hydra's run logs, when it is a valid
    name: `module.name=../../evil` is refused by the build, and must not
    have put Hydra's logs two levels above the output root first."""
    return name if is_name(name) else "invalid-module-name"


# conf/hydra/launcher/parallel.yaml and conf/config.yaml. Registered on import:
# joblib's workers resolve the launcher and sweep configs too.
OmegaConf.register_new_resolver("flashrt_parallel_jobs", default_parallel_jobs, replace=True)
OmegaConf.register_new_resolver("flashrt_logs_root", logs_root, replace=True)
OmegaConf.register_new_resolver("flashrt_logs_name", logs_name, replace=True)


def _baseline(cfg: DictConfig) -> DictConfig:
    """This job's config from its config-file choices alone (`+module=mlp`,
    `quant=int8_wo`), without its other overrides: what the variant names
    the differences from (`cfg` itself where they set nothing it names)."""
    hydra_cfg = HydraConfig.get()
    loader = GlobalHydra.instance().config_loader()
    given = list(hydra_cfg.overrides.task)
    chosen = group_overrides(given, loader.get_group_options)
    if names_nothing(given, chosen):  # the variant would be empty: no second compose
        return cfg
    return loader.load_configuration(hydra_cfg.job.config_name, chosen, RunMode.RUN)


def _config_dir() -> str | None:
    """The `--config-dir` this command was given, if any."""
    found = [s.path for s in HydraConfig.get().runtime.config_sources if s.provider == "command-line"]
    return found[0].removeprefix("file://") if found else None


def run_job(cfg: DictConfig) -> int:
    """Build one config; return its exit code instead of raising."""
    from .errors import report_failure

    naming = Naming(_baseline(cfg), _config_dir()) if HydraConfig.initialized() else None
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        from .sweep.job import run_sweep_job  # a build per fresh process, a record for the summary

        return run_sweep_job(cfg, naming)
    try:
        from .cache.plan import make_plan
        from .cache.reuse import decide

        plan = make_plan(cfg, naming=naming)  # resolved once, here, without torch
        decided = decide(plan)
        if decided.built:
            return 0
        from .pipeline import build_plan  # torch is imported only when there is work to do

        build_plan(plan, decided)
        return 0
    except Exception as exc:  # raised on purpose or not: a failed build, said in one line
        return report_failure(log, _with_shadowing(exc, naming)).exit_code


def _with_shadowing(exc: Exception, naming: Naming | None) -> Exception:
    """A config error from a config dir's file that replaced a shipped one says so."""
    from .config.paths import shadowing_note

    if not isinstance(exc, ConfigError) or naming is None or exc.kind != "config key":
        return exc
    note = shadowing_note(exc.key, naming.config_dir, HydraConfig.get().runtime.choices)
    return ConfigError(exc.key, exc.value, exc.expected + note, exc.kind) if note else exc


def up_to_date_before_hydra(composed: DictConfig, argv: list[str]) -> bool:
    """Whether the build is up to date (or filled from the store), said as
    Hydra's logging would say it, without starting Hydra: the answer needs
    the config and the key, not a run directory. Anything Hydra itself would
    do for the run (an override of `hydra.*`, a callback of the user's, the job's environment or directory)
    leaves the answer to the job; so does any problem, which the job reports."""
    import logging.config

    from omegaconf import open_dict

    from .cache.plan import make_plan
    from .cache.reuse import decide

    shipped_callbacks = {"sweep_summary"}
    if any(arg.lstrip("+~").startswith("hydra") for arg in argv) or set(composed.hydra.callbacks) != shipped_callbacks:
        return False
    if composed.hydra.job.env_set or composed.hydra.job.chdir:  # the job's environment and directory: Hydra's run
        return False
    job_logging = cast(dict[str, Any], OmegaConf.to_container(composed.hydra.job_logging))
    job_logging["handlers"].pop("file", None)  # the run directory's log: there is no run
    job_logging["root"]["handlers"] = [h for h in job_logging["root"]["handlers"] if h != "file"]
    if "${" in repr(job_logging):  # logging of the user's that names Hydra's run
        return False
    cfg = composed.copy()
    with open_dict(cfg):
        del cfg["hydra"]
    try:
        logging.config.dictConfig(job_logging)
        return decide(make_plan(cfg), say_why=False).built
    except Exception:  # the job composes it again and says what is wrong
        return False


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    _job_codes.append(run_job(cfg))


def main() -> None:
    """Console entry point (`flashrt-build`, `python -m flashrt_build`)."""
    register_schema()
    quiet_known_warnings()
    sys.argv[1:] = flags_first(sys.argv[1:])  # --config-dir after the overrides, as people type it
    try:
        composed = check_command_line(sys.argv[1:])  # before Hydra runs anything a config names
    except ConfigError as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    stop_on_signals()
    if composed is not None and up_to_date_before_hydra(composed, sys.argv[1:]):
        sys.exit(0)
    try:
        with users_configs_first():
            _hydra_main()
    except BrokenPipeError:  # `--help | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
    except Interrupted as stopped:
        exit_interrupted(stopped, functools.partial(print, file=sys.stderr))
    except SystemExit as exc:
        # Hydra exits 1 on any composition error (unknown key, wrong type,
        # missing group option): that is the command line's fault, so exit 2.
        if exc.code not in (0, None) and not _job_codes:
            sys.exit(2)
        raise
    from .sweep.summary import last_exit_code  # a sweep's verdict covers jobs other processes ran

    sys.exit(last_exit_code[0] if last_exit_code else max(_job_codes, default=0))
