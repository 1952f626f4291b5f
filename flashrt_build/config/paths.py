"""The paths a config names, checked before any work: the output locations
can be created and written, a checkpoint read, a config directory listed.
Each problem is a ConfigError naming the key and the path; nothing is created."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ..artifact import foreign_entries
from ..errors import ConfigError


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
    in_the_way = foreign_entries(output_dir)
    if in_the_way:
        listed = ", ".join(in_the_way[:5]) + (f" and {len(in_the_way) - 5} more" if len(in_the_way) > 5 else "")
        raise ConfigError(
            "output_dir",
            shown,
            f"holds {len(in_the_way)} entries that are not part of a flashrt_build artifact ({listed}); "
            "a build replaces its output directory whole, so it must be empty, new, or hold an earlier build "
            "and nothing else",
        )


def check_config_dir(key: str, path: str | Path) -> None:
    """A directory of the user's configs must be one (Hydra would say only
    that it was "not found"), and each of its YAML files must parse (Hydra
    would print a traceback from deep inside its loader)."""
    if not Path(path).exists():
        raise ConfigError(key, str(path), "no such directory")
    if not Path(path).is_dir():
        raise ConfigError(key, str(path), "is a file, not a directory of configs")
    from omegaconf import OmegaConf

    for file in sorted(Path(path).rglob("*.yaml")):
        try:
            OmegaConf.load(file)
        except Exception as exc:
            why = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
            raise ConfigError(key, str(path), f"{file} is not valid YAML: {why}") from None


def check_temp_dir() -> None:
    """The temp dir (TMPDIR) holds Inductor's compile and every loaded package's
    unpacked files; one that is not a writable directory fails the build late
    and obscurely, so refuse it first."""
    value = os.environ.get("TMPDIR")
    if not value:
        return
    why = None
    if not Path(value).is_dir():
        why = "no such directory" if not Path(value).exists() else "is not a directory"
    elif not os.access(value, os.W_OK | os.X_OK):
        why = "is not writable"
    if why:
        raise ConfigError(
            "TMPDIR", value, f"{why}: builds compile, and packages load, in the temp dir", "environment variable"
        )
