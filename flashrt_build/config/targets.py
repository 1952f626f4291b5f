"""What a config may run, and where that code comes from: every `_target_`
is code that runs when the module is built. The allow-list
(`allowed_targets`, the release profile's zoo) is checked here on the path as
written, before anything is imported; the build checks it again on what the
located object really is (stages/preflight.py). Which source files or which
installed distribution a target comes from keys the build and is recorded."""

from __future__ import annotations

import fnmatch
import hashlib
import importlib.util
import platform
from collections.abc import Iterator, Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from ..errors import ConfigError

# What a release build may instantiate without the user widening
# allowed_targets: the shipped configs' own targets, each by name
# (tests/config/test_spec.py keeps this list equal to them).
RELEASE_TARGETS = (
    "flashrt_build.causal_lm.CausalLM",
    "flashrt_build.examples.MLP",
    "flashrt_build.examples.T5Seq2Seq",
    "flashrt_build.examples.TinyLM",
    "torchvision.models.resnet50",
    "transformers.BertConfig",
    "transformers.AutoModelForCausalLM.from_pretrained",
    "transformers.BertModel",
    "transformers.GPT2Config",
    "transformers.GPT2LMHeadModel",
    "transformers.LlamaConfig",
    "transformers.LlamaForCausalLM",
    "transformers.T5Config",
)


def allowed_targets(config: Mapping[str, Any]) -> list[str]:
    """The effective allow-list: the config's patterns, plus the zoo for a release."""
    patterns = list(config.get("allowed_targets") or [])
    if config.get("release"):
        patterns = [*RELEASE_TARGETS, *patterns]
    return patterns


def allow_list_refusal(target: str, config: Mapping[str, Any]) -> str:
    """Why a `_target_` is refused, and how to admit it: the release profile
    is what restricts targets when the user set no allow-list."""
    top = target.split(".")[0]
    fix = f"to admit it, add allowed_targets=[{target}] (or a pattern such as {top}.*) on the command line"
    if config.get("release") and not config.get("allowed_targets"):
        return f"not allowed: a release build (release=true) admits only the shipped configs' targets; {fix}"
    return f"not allowed; allowed_targets: {allowed_targets(config)}; {fix}"


def target_allowed(target: str, patterns: list[str], real_name: str | None = None) -> bool:
    """Is a `_target_` on the allow-list? Before import, by the path as written
    (`real_name` None). After Hydra located the object, also by what it really
    is, `module.qualname`, because Hydra follows attributes through modules:
    `transformers.modeling_utils.torch.save` is torch's `save`. A pattern that
    names the path exactly, without wildcards, admits it as written."""
    if not any(fnmatch.fnmatchcase(target, pattern) for pattern in patterns):
        return False
    if real_name is None or target in patterns:
        return True
    return any(fnmatch.fnmatchcase(real_name, pattern) for pattern in patterns)


def find_targets(node: Any, key: str) -> list[tuple[str, Any]]:
    """Every `_target_` in a config node at any depth (nested arguments,
    `_args_` lists, `_partial_` nodes), with its full key."""
    found = []
    if isinstance(node, Mapping):
        if "_target_" in node:
            found.append((f"{key}._target_", node["_target_"]))
        for k, v in node.items():
            if k != "_target_":
                found += find_targets(v, f"{key}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            found += find_targets(v, f"{key}.{i}")
    return found


def use_import_paths(paths: Sequence[Path]) -> None:
    """Put the directories a module imports from first on `sys.path` (as
    `python -m` puts the working directory), so its target imports the same
    way in the console script, a sweep's fresh process, the verification
    process (which inherits `sys.path`) and `repro` from anywhere."""
    import importlib
    import sys

    for path in reversed(paths):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    importlib.invalidate_caches()


def _installed(path: str) -> bool:
    return any(part in ("site-packages", "dist-packages") for part in Path(path).parts)


def module_source(target: str) -> dict[str, Any]:
    """What the target's code is: its source digest, or its distribution and version."""
    top = target.split(".")[0]
    found = importlib.util.find_spec(top)
    if found is None or found.origin is None and not found.submodule_search_locations:
        return {"target": target, "unresolved": True}
    if found.origin in ("built-in", "frozen") and not found.submodule_search_locations:
        return {"target": target, "python": platform.python_version()}  # the interpreter's own code: no file
    root = str(found.submodule_search_locations[0] if found.submodule_search_locations else found.origin)
    dist = distribution_of(top) if _installed(root) else None
    if dist is not None:
        return {"target": target, "distribution": dist[0], "version": dist[1]}
    sha, count = source_tree_sha256(root)
    return {"target": target, "source_sha256": sha, "files": count}


def distribution_of(top: str) -> tuple[str, str] | None:
    """(name, version) of the installed distribution that provides the top-level
    package `top`. The distribution named like the package first: scanning
    every distribution's file list (`packages_distributions`) takes half a
    second beside CUDA torch's thousands of files, on every up-to-date check."""
    try:
        dist = metadata.distribution(top)
        provided = (dist.read_text("top_level.txt") or "").split() or [
            str(f).split("/")[0] for f in dist.files or [] if "/" in str(f)
        ]
        if top in provided:
            return dist.metadata["Name"], dist.version
    except metadata.PackageNotFoundError:
        pass
    names = metadata.packages_distributions().get(top, [])
    return (names[0], metadata.version(names[0])) if names else None


def source_tree_sha256(root: str) -> tuple[str, int]:
    """sha256 over a package's .py files (relative paths and contents) and their count."""
    digest = hashlib.sha256()
    base = Path(root)
    files = sorted(base.rglob("*.py")) if base.is_dir() else [base]
    for path in files:
        digest.update(str(path.relative_to(base) if base.is_dir() else path.name).encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest(), len(files)


# What Hydra runs from its own node, outside the build, admitted without the
# user's allow-list: the shipped configs' callbacks, launchers and sweepers.
HYDRA_TARGETS = (
    "flashrt_build.sweep.summary.SweepSummary",
    "hydra._internal.core_plugins.*",
    "hydra_plugins.hydra_joblib_launcher.*",
    "hydra_plugins.hydra_submitit_launcher.*",
)
# Objects a logging config may name (`()`, `class`, `ext://`) without the
# allow-list: handlers, formatters and filters, never a function of the
# logging package (`logging.config.fileConfig` evaluates what a file says).
LOGGING_OBJECTS = (
    "logging.*Handler", "logging.handlers.*Handler", "logging.Formatter", "logging.Filter", "sys.stdout", "sys.stderr",
)  # fmt: skip


def hydra_code_problems(
    hydra: Mapping[str, Any], patterns: list[str], overrides: Sequence[str], shipped_setup: Sequence[str] = ()
) -> list[ConfigError]:
    """Under an allow-list (`patterns`), the code Hydra itself would run from
    its node before and around the build: callbacks, launcher and sweeper
    `_target_`s, logging factories, classes and `ext://` objects, job
    environment variables (`LD_PRELOAD` runs code) and a launcher's shell
    `setup` lines. Each must be Hydra's or the tool's own, on the allow-list,
    or given on the command line."""
    problems = []
    allowed = [*HYDRA_TARGETS, *patterns]
    for section in ("callbacks", "launcher", "sweeper"):
        for key, target in find_targets(hydra.get(section), f"hydra.{section}"):
            if not isinstance(target, str) or not any(fnmatch.fnmatchcase(target, p) for p in allowed):
                problems.append(ConfigError(key, target, "is code Hydra runs, which the allow-list does not admit"))
    for section in ("job_logging", "hydra_logging"):
        for key, name in _logging_objects(hydra.get(section), f"hydra.{section}"):
            if not any(fnmatch.fnmatchcase(name, p) for p in (*LOGGING_OBJECTS, *patterns)):
                problems.append(ConfigError(key, name, "is code logging runs, which the allow-list does not admit"))
    given = {o.partition("=")[0].lstrip("+~") for o in overrides}
    for name, value in ((hydra.get("job") or {}).get("env_set") or {}).items():
        if f"hydra.job.env_set.{name}" not in given:
            problems.append(
                ConfigError(
                    f"hydra.job.env_set.{name}",
                    value,
                    "set by a config file under an allow-list: environment variables reach every process "
                    "of the build (LD_PRELOAD runs code); set them in your environment instead",
                )
            )
    setup = (hydra.get("launcher") or {}).get("setup") or []
    if "hydra.launcher.setup" not in given:
        for i, line in enumerate(setup):
            if line not in shipped_setup:
                problems.append(
                    ConfigError(f"hydra.launcher.setup.{i}", line, "a shell line the allow-list does not admit")
                )
    return problems


def _logging_objects(node: Any, key: str) -> Iterator[tuple[str, str]]:
    """(key, dotted name) of every object a logging dictConfig imports."""
    if isinstance(node, Mapping):
        for k, v in node.items():
            if k in ("()", "class") and isinstance(v, str):
                yield f"{key}.{k}", v
            else:
                yield from _logging_objects(v, f"{key}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _logging_objects(v, f"{key}.{i}")
    elif isinstance(node, str) and node.startswith("ext://"):
        yield key, node.removeprefix("ext://")
