"""Every file a build reads, as its config names them (the way Bazel
declares a target's inputs): the checkpoint's files, and every file or
directory that a string under `module.model` names and that exists when the
build starts (a `from_pretrained` directory, a path a factory of the user's
reads). Each becomes an input of the build key, so a build is never "up to
date" after one of them changed on disk."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..artifact import STAGING_PREFIX, build_in
from ..errors import ConfigError
from ..runtime.formats import Checkpoint, holds_checkpoint, resolve_checkpoint

# Files that hold weight values: they key the weights, not the compiled graph,
# so a new checkpoint of the same model reuses its compiled package.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".index.json", ".gguf", ".h5", ".npz", ".msgpack")
# A directory named in module.model with more files than this is refused: its
# every file would be hashed (`.`, a home directory), which is not what anyone meant.
MAX_DIR_FILES = 10_000


@dataclass(frozen=True)
class InputFile:
    """One file a build reads."""

    key: str  # the config key naming it (`module.checkpoint`, `module.model.pretrained_model_name_or_path`)
    name: str  # its path relative to what the key names (`model-00001-of-00003.safetensors`)
    path: Path
    kind: str  # "weights" (keys the weights) or "model" (keys the compiled graph)

    @property
    def label(self) -> str:
        """How the build key and the manifest name it."""
        return f"{self.key}/{self.name}"


def checkpoint_files(checkpoint: Checkpoint) -> list[InputFile]:
    return [InputFile("module.checkpoint", checkpoint.name(f), f, "weights") for f in checkpoint.files]


def model_files(
    model: Any, cwd: Path, skip: Path | None = None, named: Mapping[str, str] | None = None
) -> list[InputFile]:
    """Files that strings under `module.model` name (`_target_`s aside),
    relative to `cwd`; a directory contributes every file in it, except under
    `skip` (the output root), and a checkpoint in it (an index and its shards)
    is checked as `module.checkpoint` is. `named`: the key a user set for a
    value interpolated into `module.model` (`module.pretrained`), which
    problems name."""
    found: list[InputFile] = []
    for key, value in config_strings(model, "module.model"):
        path = cwd / value
        try:
            exists = path.exists()
        except (OSError, ValueError):  # a name too long, a NUL byte: no path
            continue
        if not exists:
            continue
        if path.is_file():
            found.append(InputFile(key, path.name, path, _kind(path.name)))
            continue
        said = (named or {}).get(value, key)
        if holds_checkpoint(path):  # an index naming a shard outside the directory is refused, as for a checkpoint
            resolve_checkpoint(said, value, path)
        files = directory_files(said, value, path, skip)
        found += [InputFile(key, str(f.relative_to(path)), f, _kind(f.name)) for f in files]
    return found


def ours(path: Path, is_dir: bool) -> bool:
    """An entry a build of this tool put there (an output directory inside a
    model's, the lock beside it, a staging directory): never an input."""
    if is_dir:
        return path.name.startswith(STAGING_PREFIX) or build_in(path) is not None
    return path.name.startswith(".") and path.name.endswith(".lock")


def directory_files(key: str, value: str, root: Path, skip: Path | None = None) -> list[Path]:
    """Every regular file under `root`, in name order, file links followed (a
    hub cache's files are links), except under `skip`; a link to a directory
    outside it, or back to one it is in (a loop), is refused, never walked."""
    files: list[Path] = []

    def visit(folder: Path, above: frozenset[Path]) -> None:
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError as exc:
            where = folder.relative_to(root) if folder != root else Path(".")
            raise ConfigError(key, value, f"holds {where}, which cannot be read ({exc.strerror or exc})") from None
        for entry in entries:
            path = Path(entry.path)
            try:
                is_dir, is_file = entry.is_dir(), entry.is_file()  # both follow links
            except OSError as exc:
                raise ConfigError(
                    key, value, f"holds {path.relative_to(root)}, which cannot be read ({exc.strerror or exc})"
                ) from None
            if ours(path, is_dir):  # a build of this tool's, its lock or its staging: not the model's
                continue
            if is_dir:
                real = path.resolve()
                if entry.is_symlink() and not real.is_relative_to(top):  # a file link may leave (a hub cache's do)
                    raise ConfigError(
                        key,
                        value,
                        f"holds {path.relative_to(root)}, a link to {real}, a directory outside it: its files are "
                        "not the model's; copy what the model needs into its directory",
                    )
                if real in above:
                    raise ConfigError(
                        key,
                        value,
                        f"holds {path.relative_to(root)}, a link to {real}, a directory it is in: a loop, whose "
                        "files would be read again at every turn; remove the link",
                    )
                if real != skip:
                    visit(path, above | {real})
            elif is_file:
                files.append(path)
                if len(files) > MAX_DIR_FILES:
                    raise ConfigError(
                        key,
                        value,
                        f"names a directory of more than {MAX_DIR_FILES} files, each of which would be an input of "
                        "the build key; name the model's own directory",
                    )

    top = root.resolve()
    visit(root, frozenset({top}))
    return files


def served_files(key: str, given: list[str], cwd: Path) -> list[InputFile]:
    """`module.files`: files copied beside the package (a tokenizer), each a
    regular file with a name of its own that no artifact file has."""
    from ..artifact import ARTIFACT_FILES

    found: list[InputFile] = []
    for i, value in enumerate(given):
        path = cwd / Path(value).expanduser()
        if not path.is_file():
            why = "no such file" if not path.exists() else "not a regular file"
            raise ConfigError(f"{key}.{i}", value, f"{why}: a file copied beside the package")
        if path.name in ARTIFACT_FILES or path.name in (f.name for f in found):
            raise ConfigError(f"{key}.{i}", value, f"its name {path.name!r} is taken in the output directory")
        if path.name in JSON_SERVING_FILES:
            _check_json(f"{key}.{i}", value, path)
        if path.name == "chat_template.jinja":
            try:
                path.read_bytes().decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ConfigError(f"{key}.{i}", value, f"chat_template.jinja is not UTF-8 text (byte {exc.start}): "
                                  "generate --chat renders it as text") from None  # fmt: skip
        found.append(InputFile(key, path.name, path, "weights"))
    return found


def _check_json(key: str, value: str, path: Path) -> None:
    """A tokenizer's JSON file or generation_config.json that does not parse
    is refused at the build, not when a prompt is first served from it; so
    are the values of theirs that serving would fail on (`generate`'s
    end-of-sequence tokens) or could not serve without running a directory's
    own code (a tokenizer_config.json's `auto_map`)."""
    from ..runtime.tokenizer import auto_map_of, eos_token_ids

    try:
        data = json.loads(path.read_bytes(), parse_constant=_not_json)
    except ValueError as exc:  # JSONDecodeError, or bytes that are no text
        raise ConfigError(
            key, value, f"{path.name} does not parse as JSON ({exc}); serving text from the package reads it as JSON"
        ) from None
    if path.name == "generation_config.json":
        if not isinstance(data, dict):
            raise ConfigError(key, value, f"generation_config.json holds a {type(data).__name__}, not a JSON object")
        if data.get("eos_token_id") is not None:
            try:
                eos_token_ids(data["eos_token_id"], "its eos_token_id", then=", the tokens generate stops at")
            except ValueError as exc:
                raise ConfigError(key, value, str(exc)) from None
    if path.name == "tokenizer.json":
        _check_tokenizer(key, value, path)
    code = auto_map_of(data) if path.name == "tokenizer_config.json" else None
    if code is not None:
        raise ConfigError(
            key, value, f"its auto_map names tokenizer code of its own ({code}): the served tokenizer would need "
            "its directory's code, which is never run; serve a model whose tokenizer transformers ships"
        )  # fmt: skip


def _check_tokenizer(key: str, value: str, path: Path) -> None:
    """A tokenizer.json the `tokenizers` library (what serves it) cannot
    read is no tokenizer, whatever JSON it holds."""
    try:
        from tokenizers import Tokenizer
    except ImportError:  # the build does not need it: serving will say so
        return
    try:
        Tokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 - the library's own refusal, named
        said = " ".join(str(exc).split())[:200]
        raise ConfigError(
            key, value, f"tokenizer.json is not a tokenizer the tokenizers library reads ({said})"
        ) from None


def _not_json(constant: str) -> None:
    """NaN and Infinity, which Python's reader takes and JSON has not (a
    generation config holding one breaks transformers far from here)."""
    raise ValueError(f"{constant} is not a JSON value")


# Files a served model reads beside its package: they key the artifact, not the compiled graph.
SERVING_FILES = frozenset(
    {"tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "added_tokens.json",
     "vocab.json", "merges.txt", "chat_template.jinja", "generation_config.json"}
)  # fmt: skip


# Those of them a tokenizer or `generate` parses as JSON.
JSON_SERVING_FILES = frozenset(
    {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
     "chat_template.json", "generation_config.json"}
)  # fmt: skip


def _kind(name: str) -> str:
    return "weights" if name.endswith(WEIGHT_SUFFIXES) or name in SERVING_FILES else "model"


def config_strings(node: Any, key: str) -> Iterator[tuple[str, str]]:
    """Every non-empty string in a config node (`_target_`s aside), with its full key."""
    if isinstance(node, str) and node:
        yield key, node
    elif isinstance(node, Mapping):
        for k, v in node.items():
            if k != "_target_":
                yield from config_strings(v, f"{key}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from config_strings(v, f"{key}.{i}")
