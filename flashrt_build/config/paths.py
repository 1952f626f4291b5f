"""The paths a config names, checked before any work: the output locations
(derived from the choices, never a timestamp) can be created and written and
a build may replace them, a config directory listed, the temp dir used.
Each problem is a ConfigError naming the key and the path; nothing is created."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..artifact import STORE_DIR, build_in, enclosing_build, foreign_entries
from ..errors import ConfigError
from ..runtime.tempdir import check_temp_dir as check_temp_dir  # the config checks it before a build
from .inputs import MAX_NAME, NAME, NAME_RULE, is_name
from .problems import Problems


def check_writable(path: Path, key: str = "output_dir", beside: bool = True) -> None:
    """Refuse, before any work and creating nothing, a directory that could
    not be created or written, naming its config key: an existing file in the
    way, a missing or read-only filesystem, no permission. Probed by creating
    (and at once removing) a nameless file where the build will write: beside
    an existing output dir (staging, lock), inside an output root."""
    where = path.parent if beside and path.is_dir() else path
    while not where.exists() and where != where.parent:
        where = where.parent
    if path.exists() and not path.is_dir():
        raise ConfigError(key, str(path), "exists and is not a directory")
    if not where.is_dir():
        raise ConfigError(key, str(path), f"cannot be created: {where} is a file, not a directory")
    try:
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as exc:
        why = exc.strerror or str(exc)
        raise ConfigError(key, str(path), f"cannot be written: creating a file in {where} fails ({why})") from None


def check_output_dir(output_dir: Path, output_root: Path, cwd: Path, given: str | None = None) -> None:
    """A build replaces its output directory whole (staged beside it, then
    swapped in), so refuse, before any work, a directory whose replacement
    would delete what the build did not make: one that is, or contains, `/`,
    the home directory, the current directory or the output root (every
    build, the store and the logs), or one holding anything but an earlier
    build of this tool. `output_dir` is already resolved: a symlink is judged
    by its target, which is what would be replaced."""
    value = given if given is not None else str(output_dir)
    shown = value if str(output_dir) == value else f"{value} (resolved: {output_dir})"
    store = Path(os.path.realpath(output_root / STORE_DIR))
    if output_dir == store or store in output_dir.parents:
        raise ConfigError("output_dir", shown, f"is in the build store ({store}), which only the store writes")
    guarded = {
        "the filesystem root": Path("/"),
        "the home directory": Path.home(),
        "the current directory": cwd,
        "output_root": output_root,
    }
    for what, place in guarded.items():
        place = Path(os.path.realpath(place))
        if output_dir == place or output_dir in place.parents:
            relation = "is" if output_dir == place else "contains"
            raise ConfigError(
                "output_dir",
                shown,
                f"{relation} {what} ({place}); a build replaces its output directory whole, "
                "so give it a directory of its own",
            )
    inside = enclosing_build(output_dir)
    if inside is not None:
        raise ConfigError(
            "output_dir", shown, f"is inside {inside}, another build's artifact, which would then refuse to serve "
            "(it holds only what its build wrote): give a directory outside it"
        )  # fmt: skip
    refuse_foreign(output_dir, shown)


def refuse_foreign(
    output_dir: Path, shown: str, altered: Callable[[Path, Mapping[str, Any]], bool] | None = None
) -> None:
    """A ConfigError when `output_dir` holds anything but an earlier build
    (`artifact.foreign_entries`; given `altered`, a file of the size its
    build wrote but other bytes is in the way too)."""
    in_the_way = foreign_entries(output_dir, altered)
    if in_the_way:
        listed = ", ".join(in_the_way[:5]) + (f" and {len(in_the_way) - 5} more" if len(in_the_way) > 5 else "")
        raise ConfigError(
            "output_dir",
            shown,
            f"holds {len(in_the_way)} entries that are not part of a flashrt_build artifact ({listed}); "
            "a build replaces its output directory whole, so it must be empty, new, or hold an earlier build "
            "and nothing else",
        )


def check_config_dir(key: str, path: str | Path, own_primary: bool = False) -> None:
    """A directory of the user's configs must be one (Hydra would say only
    that it was "not found"), and each of its YAML files must parse (Hydra
    would print a traceback from deep inside its loader). Its files win over
    the shipped ones of the same name, so a `config.yaml` at its top would
    replace the tool's own config: refused, unless `own_primary` (the command
    line names a primary config of its own, `--config-name`)."""
    if not Path(path).exists():
        raise ConfigError(key, str(path), "no such directory")
    if not Path(path).is_dir():
        raise ConfigError(key, str(path), "is a file, not a directory of configs")
    from .schema import SCHEMA_NAME

    tools = {"config.yaml": "the tool's own config", f"{SCHEMA_NAME}.yaml": "the tool's typed schema"}
    for name, what in tools.items():
        if (Path(path) / name).is_file() and not (own_primary and name == "config.yaml"):
            where = "; a module goes in module/NAME.yaml" if name == "config.yaml" else ""
            raise ConfigError(
                key,
                str(path),
                f"holds {name}, which would replace {what} (a config dir's files win over the shipped ones of the "
                f"same name): rename it{where}",
            )
    import yaml
    from omegaconf import OmegaConf

    for file in sorted(Path(path).rglob("*.yaml")):
        if not file.is_file():  # a FIFO would block the read, a device never end
            raise ConfigError(key, str(path), f"{file} is not a regular file, so not a config")
        try:
            text = file.read_bytes()
            shape = _yaml_shape_problem(yaml.compose(text, Loader=yaml.SafeLoader))
            if shape is not None:
                raise ConfigError(key, str(path), f"{file} {shape}")
            OmegaConf.load(file)
            top = yaml.safe_load(text)
        except ConfigError:
            raise
        except RecursionError:
            raise ConfigError(key, str(path), f"{file} nests deeper than a config can be read") from None
        except Exception as exc:
            why = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
            why = why if len(why) <= 300 else why[:300] + " ..."  # one line, whatever the parser quotes
            raise ConfigError(key, str(path), f"{file} is not valid YAML: {why}") from None
        if top is not None and not isinstance(top, dict):  # OmegaConf would read a text as a key named by all of it
            raise ConfigError(key, str(path), f"{file} holds a {type(top).__name__}, not a mapping of config keys")


# Values a config file may expand to through its aliases (a file of a few
# lines whose aliases nest can name billions).
MAX_YAML_VALUES = 1_000_000


def _yaml_shape_problem(root: Any) -> str | None:
    """What makes a composed YAML node graph no config: an alias that
    contains itself, or aliases that expand past MAX_YAML_VALUES; None when
    neither does. Each node is counted once, however often it is aliased."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: Any) -> int:
        if id(node) in sizes:
            return sizes[id(node)]
        if id(node) in open_nodes:
            raise _AliasLoop
        open_nodes.add(id(node))
        children = node.value if isinstance(node.value, list) else []
        items = [part for child in children for part in (child if isinstance(child, tuple) else (child,))]
        total = 1 + sum(size(child) for child in items)
        open_nodes.discard(id(node))
        sizes[id(node)] = total
        return total

    try:
        expanded = 0 if root is None else size(root)
    except _AliasLoop:
        return "holds a YAML alias that contains itself"
    return f"expands its aliases to more than {MAX_YAML_VALUES} values" if expanded > MAX_YAML_VALUES else None


class _AliasLoop(Exception):
    pass


def derive_output_dir(config: Mapping[str, Any], cwd: Path) -> Path:
    """The build's output directory: `output_dir`, or one derived from choices.

    Derived: `<output_root>/<module>/<target>-<weights>-<inductor>[-<quant>][-<passes>][-<variant>]`
    (the quant recipe and the passes unless `none`), never a timestamp, so a rebuild lands
    where the last one did.
    """
    root = (cwd / Path(config["output_root"]).expanduser()).resolve()
    if config.get("output_dir"):
        return (cwd / Path(config["output_dir"]).expanduser()).resolve()  # `~`: the home directory
    for key in ("target.name", "inductor.name", "quant.name", "passes.name"):  # each names a part of the folder
        group = key.partition(".")[0]
        label = (config.get(group) or {}).get("name", "none")
        if not isinstance(label, str) or not NAME.match(label):
            raise ConfigError(key, label, "names a part of the output folder: expected letters, digits, '_', '.', '-'")
    parts = [config["target"]["name"], str(config["weights"]), config["inductor"]["name"]]
    for group in ("quant", "passes"):
        if config.get(group, {}).get("name", "none") != "none":
            parts.append(config[group]["name"])
    if config.get("variant"):
        parts.append(config["variant"])
    leaf = "-".join(parts)
    name = config["module"]["name"]
    if not is_name(name) or not NAME.match(leaf) or len(leaf) > 2 * MAX_NAME:
        return root / "invalid"  # module.name or variant is reported by resolve_spec
    path = (root / name / leaf).resolve()
    if root not in path.parents:
        raise ConfigError("module.name", name, f"the build directory must stay inside output_root {root}")
    return path


def resolve_outputs(config: Mapping[str, Any], cwd: Path, problems: Problems) -> tuple[Path, Path | None]:
    """(output_root, output_dir), each writable, the output dir one a build
    may replace; every problem added to `problems`."""
    variant = config.get("variant")
    if variant is not None and not is_name(str(variant)):
        problems.append(ConfigError("variant", variant, f"expected {NAME_RULE}"))
    output_dir = problems.check(derive_output_dir, config, cwd)
    before = len(problems)
    output_root = (cwd / Path(config["output_root"]).expanduser()).resolve()
    inside = enclosing_build(output_root / STORE_DIR)
    if inside is not None:  # its store and builds would be entries its build did not write
        where = f"is {'' if inside == output_root else 'inside '}{inside}, a build's artifact"
        why = f"{where}, which would then refuse to serve: give a directory outside it"
        problems.append(ConfigError("output_root", config["output_root"], why))
    root_ok = problems.check(check_writable, output_root, "output_root", False) is None and len(problems) == before
    if output_dir is not None and (root_ok or config.get("output_dir")):  # a derived dir fails with its root
        before = len(problems)
        problems.check(check_writable, output_dir, "output_dir")
        if len(problems) == before:  # what publishing would replace
            problems.check(check_output_dir, output_dir, output_root, cwd, config.get("output_dir"))
            problems.check(check_same_model, output_dir, config)
    return output_root, output_dir


def check_same_model(output_dir: Path, config: Mapping[str, Any]) -> None:
    """An LLM's folder is named after its directory: the build of another
    model that lands on it (a directory of the same name elsewhere, or one
    named like a module) would replace it silently. Refused, naming both."""
    manifest = build_in(output_dir)
    if manifest is None:
        return
    theirs = ((manifest.get("config") or {}).get("module") or {}).get("pretrained")
    ours = config["module"].get("pretrained")
    if theirs == ours or (theirs and ours and os.path.realpath(theirs) == os.path.realpath(ours)):
        return  # the same directory, perhaps through a link
    what = theirs or (manifest.get("module") or {}).get("target")
    raise ConfigError(
        "output_dir",
        str(output_dir),
        f"holds the build of {what}, another model than {ours or config['module']['model'].get('_target_')}: "
        "remove it, or keep both with module.name=NAME (or output_dir=DIR)",
    )


def shadowing_note(key: str, config_dir: str | Path | None, choices: Mapping[str, Any]) -> str:
    """Where a config dir's file replaced the shipped config the error's key
    comes from (`target/cpu.yaml` holding `device: cuda`), the words that say
    so; else "". A config dir's files win over the shipped ones of the same
    name, which the key alone does not show."""
    from .shipped import CONF_DIR

    group = key.lstrip("+~").partition(".")[0]
    choice = choices.get(group)
    if config_dir is None or not isinstance(choice, str):
        return ""
    theirs = Path(config_dir) / group / f"{choice}.yaml"
    if not (theirs.is_file() and (CONF_DIR / group / f"{choice}.yaml").is_file()):
        return ""
    return f" ({group}={choice} is {theirs}, which replaces the shipped {group}/{choice}.yaml)"
