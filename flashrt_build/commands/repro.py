"""`python -m flashrt_build.repro OUTPUT_DIR`: rebuild a release artifact from
its own manifest and compare, like `nix build --check`.

Exit 0 when every file is byte-identical, 1 otherwise (each differing file
and, for the package, each differing zip member is named) or when the
rebuild fails, 2 when it cannot check (not a release build, no complete
build, an unreadable file) or the command line is wrong.
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from ..artifact import MANIFEST, written_files
from ..errors import ConfigError, command_verdict
from ..runtime.hashing import file_sha256
from ..runtime.manifest import read_manifest

log = logging.getLogger("flashrt_build")


def differing_members(a: Path, b: Path) -> list[str]:
    """Zip members whose bytes differ, or that only one archive has."""
    with zipfile.ZipFile(a) as za, zipfile.ZipFile(b) as zb:
        names_a, names_b = set(za.namelist()), set(zb.namelist())
        differ = sorted(names_a ^ names_b)
        differ += sorted(n for n in names_a & names_b if za.read(n) != zb.read(n))
    return differ


def reproduce(output_dir: str | Path, trust: bool = False) -> dict[str, list[str]]:
    """Rebuild `output_dir`'s release artifact in a temporary directory; the
    differences by file (zip members for the package), empty when identical.
    The manifest is the artifact's word, not the user's: what in it would
    choose code beyond the release's own allow-list (its allowed_targets,
    python_path, toolchain.cxx) is honoured only with `trust`."""
    from ..pipeline import build

    output_dir = Path(output_dir)
    manifest = read_manifest(output_dir)
    if not manifest.get("release"):
        raise ConfigError("release", False, f"{output_dir} is not a release build; repro checks release=true builds")
    check_inputs(manifest)
    config = copy.deepcopy(manifest["config"])
    config["release"] = True  # its allow-list, whatever the manifest's config says
    if not trust:
        for said in untrusted(config):
            log.warning("repro: %s", said)
    checkpoint = manifest["module"].get("checkpoint")
    if checkpoint:
        config["module"]["checkpoint"] = checkpoint["path"]
    with tempfile.TemporaryDirectory(prefix="flashrt-repro-") as tmp:
        rebuilt = Path(tmp) / "rebuild"
        config.update(output_dir=str(rebuilt), output_root=tmp, force=True, variant=None)
        config["verify"]["enabled"] = False  # the bytes are the question here
        build(config)
        differences: dict[str, list[str]] = {}
        for name in (name for name in written_files(manifest) if name != MANIFEST):
            if not (rebuilt / name).is_file():
                differences[name] = ["(not produced by the rebuild)"]
            elif file_sha256(output_dir / name) != file_sha256(rebuilt / name):
                zipped = zipfile.is_zipfile(output_dir / name) and zipfile.is_zipfile(rebuilt / name)
                differences[name] = differing_members(output_dir / name, rebuilt / name) if zipped else [name]
    return differences


def untrusted(config: dict[str, Any]) -> list[str]:
    """Set aside what of a manifest's config would choose code the release's
    own allow-list does not judge: a widened allowed_targets (and the import
    path its code came from), the compiler; each one said (`--trust` keeps
    them). The shipped targets import from this environment, never from the
    path the release recorded, which could shadow them."""
    said = []
    if config.get("allowed_targets"):
        said.append(
            f"the release admits allowed_targets={config['allowed_targets']} from python_path="
            f"{config.get('python_path')}: not used (code the manifest chooses); --trust uses them"
        )
    config["allowed_targets"], config["python_path"] = [], []
    from ..config.compiler import inductor_option_nodes

    for _, options in inductor_option_nodes(config):
        said += _set_aside_code_options(options)
    toolchain = config.setdefault("toolchain", {})
    if toolchain.get("cxx"):
        said.append(
            f"the release's toolchain.cxx={toolchain['cxx']} is not used (the environment's is): --trust uses it"
        )
        toolchain["cxx"] = None
    return said


def _set_aside_code_options(options: Any) -> list[str]:
    """Remove from one set of Inductor options (nested or dotted) those
    that may name code (compiler.code_options), each said."""
    from ..config.compiler import code_options, flatten_options

    if not isinstance(options, dict):  # a forged manifest's: the build's own check names it
        return []
    said = []
    for name in code_options(flatten_options(options)):  # every spelling: dotted, nested, or both at once
        value = _pop_every_spelling(options, name.split("."))
        said.append(f"the release's Inductor option {name}={value} is not used (it may name code): --trust uses it")
    return said


def _pop_every_spelling(node: dict[str, Any], parts: list[str]) -> Any:
    """Remove an option from nested options under every spelling of its
    dotted name (`a.b.c`, `{a: {b.c}}`, `{a.b: {c}}`, ...); the last value found."""
    found = None
    for i in range(1, len(parts) + 1):
        key = ".".join(parts[:i])
        if key not in node:
            continue
        if i == len(parts):
            found = node.pop(key)
        elif isinstance(node[key], dict):
            inner = _pop_every_spelling(node[key], parts[i:])
            found = inner if inner is not None else found
    return found


def check_inputs(manifest: dict[str, Any]) -> None:
    """Every file the release read, as it read it: a rebuild from other
    inputs would differ for that reason alone, so a changed one is named
    (cannot check), not blamed on the toolchain: by the key the user set
    (`module.pretrained`, not the `module.model` key it fills)."""
    pretrained = ((manifest.get("config") or {}).get("module") or {}).get("pretrained")
    for entry in manifest.get("build_inputs") or []:
        path = Path(entry["path"])
        found = file_sha256(path) if path.is_file() else None
        if found == entry["sha256"]:
            continue
        what = (
            "is gone"
            if found is None
            else f"changed since the release (sha256 {found[:12]}, not {entry['sha256'][:12]})"
        )
        key = entry["key"]
        if pretrained and key.startswith("module.model.") and Path(pretrained) in (path, *path.parents):
            key = "module.pretrained"
        raise ConfigError(key, str(path), f"{what}: repro rebuilds from the inputs the release read")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashrt_build.repro", description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", type=Path)
    parser.add_argument(
        "--trust",
        action="store_true",
        help="use the code the release's manifest names beyond the shipped allow-list (its allowed_targets, "
        "python_path, toolchain.cxx): you vouch for the manifest",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    return command_verdict(
        lambda: reproduce(args.output_dir, args.trust),
        f"reproduced: every file of {args.output_dir} is byte-identical",
        f"not reproduced: {args.output_dir} differs from its rebuild",
    )


if __name__ == "__main__":
    sys.exit(main())
