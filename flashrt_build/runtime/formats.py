"""Checkpoint files, looked at without torch (so the config checks can, before any work): a file, or a
directory as `save_pretrained` writes it (an index naming its shards, or a
lone `model.safetensors` / `pytorch_model.bin`). Each file must be complete
and of a format the build reads (safetensors, or a torch state dict: a zip
archive or the legacy pickle format). What is wrong is a ConfigError naming
the key, the file and why."""

from __future__ import annotations

import errno
import json
import os
import stat
import struct
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError
from .dtypes import ITEMSIZE

_MAX_HEADER = 100 << 20  # safetensors' own limit


# What save_pretrained writes, in the order transformers' from_pretrained
# searches a directory for it: where a directory holds two (a lone file beside
# an index), the build, `load(weights=DIR)` and `check` read the one it reads.
HF_LAYOUTS = (
    ("model.safetensors", "safetensors"),
    ("model.safetensors.index.json", "safetensors"),
    ("pytorch_model.bin", "torch"),
    ("pytorch_model.bin.index.json", "torch"),
)


@dataclass(frozen=True)
class Checkpoint:
    """The files of a checkpoint, found and checked: one file, or a
    directory's shards in the order its index first names them."""

    path: Path  # as the config names it: a file or a directory
    files: tuple[Path, ...]
    format: str  # "safetensors" or "torch"
    # A sharded directory's index: tensor name -> the shard file holding it.
    weight_map: Mapping[str, str] = field(default_factory=dict)

    def name(self, file: Path) -> str:
        """How logs and the manifest name one of its files: relative to the directory."""
        return str(file.relative_to(self.path)) if self.path.is_dir() else file.name


def checkpoint_format(path: Path) -> str:
    """The format of a file that is a complete checkpoint, "safetensors" or
    "torch"; else a ValueError saying why it is not one. Reads at most the
    header a regular file declares, and nothing of anything else."""
    if not path.is_file():
        raise ValueError(f"{_special(path)}, not a checkpoint file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) == 8:
            (length,) = struct.unpack("<Q", head)
            if 2 <= length <= min(_MAX_HEADER, size - 8):
                text = f.read(length)
                if text[:1] == b"{":
                    _check_safetensors(text, size - 8 - length)
                    return "safetensors"
    if zipfile.is_zipfile(path):
        try:
            with zipfile.ZipFile(path) as archive:
                archive.namelist()
        except (zipfile.BadZipFile, OSError) as exc:
            raise ValueError(f"a torch checkpoint whose zip archive is damaged ({exc})") from None
        return "torch"
    if head[:1] == b"\x80":  # a pickle stream: torch.save's legacy format
        return "torch"
    if path.suffix == ".safetensors":
        raise ValueError(f"not a safetensors file: its first bytes {head!r} are no header length followed by JSON")
    raise ValueError(f"neither a safetensors file nor a torch checkpoint (it begins with {head!r})")


def _check_safetensors(text: bytes, data_size: int) -> None:
    """A header safetensors itself would accept: a JSON object whose every
    tensor has a known dtype, a shape of sizes and integer offsets that tile
    the data exactly (no gap, no overlap, nothing past its end). Reading a
    file that breaks any of these is a TypeError deep in a library, or worse."""
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not a valid safetensors file: its header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError("not a valid safetensors file: its header is not a JSON object")
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise ValueError("not a valid safetensors file: its __metadata__ is not a map of strings")
            continue
        spans.append((*_tensor_span(name, entry), name))
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            what = "overlaps the tensor before it" if begin < end else f"leaves bytes {end}-{begin} unused"
            raise ValueError(f"not a valid safetensors file: tensor {name!r} {what} (data_offsets [{begin}, {stop}])")
        end = stop
    if end > data_size:
        raise ValueError(
            f"a truncated safetensors file: its header places tensor data up to byte {end} of the data, "
            f"which holds {data_size} bytes"
        )
    if end < data_size:
        raise ValueError(f"not a valid safetensors file: {data_size - end} bytes after its last tensor's data")


def _tensor_span(name: str, entry: object) -> tuple[int, int]:
    """(begin, end) of one header entry's data, once its fields are checked."""
    bad = f"not a valid safetensors file: the header entry for {name!r}"
    if not isinstance(entry, dict):
        raise ValueError(f"{bad} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in ITEMSIZE:
        raise ValueError(f"{bad} has dtype {dtype!r}, not one of {', '.join(sorted(ITEMSIZE))}")
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise ValueError(f"{bad} has shape {shape!r}, expected a list of sizes >= 0")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(n) is int for n in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise ValueError(f"{bad} has data_offsets {offsets!r}, expected [begin, end] with 0 <= begin <= end")
    count = 1
    for n in shape:
        count *= n
    if offsets[1] - offsets[0] != count * ITEMSIZE[dtype]:
        raise ValueError(
            f"{bad} has {offsets[1] - offsets[0]} bytes of data, but shape {shape} of {dtype} takes "
            f"{count * ITEMSIZE[dtype]}"
        )
    return offsets[0], offsets[1]


def resolve_checkpoint(key: str, value: str, path: Path) -> Checkpoint:
    """The checkpoint a config names, every file of it checked, or a
    ConfigError naming `key`, the file and what is wrong: missing, unreadable,
    truncated, of no format the build reads; for a directory, no checkpoint
    in it, an index that is not one, or that names a shard outside the
    directory or one that is not there."""
    if not path.exists():
        raise ConfigError(key, value, _missing(path))
    if not path.is_dir():
        if not path.is_file():  # /dev/zero never ends, a FIFO never answers
            raise ConfigError(key, value, f"is {_special(path)}, not a checkpoint file")
        return Checkpoint(path, (path,), _file_format(key, value, path))
    for name, fmt in _layouts(key, value, path):
        found = path / name
        if found.exists() and not found.is_file():  # a FIFO never answers: named, never opened
            raise ConfigError(key, value, f"holds {name}, which is {_special(found)}, not a regular file")
        if found.is_file():
            if not name.endswith(".index.json"):
                return Checkpoint(path, (found,), _expect(key, value, found, fmt))
            weight_map = _weight_map(key, value, found)
            shards = [path / shard for shard in dict.fromkeys(weight_map.values())]
            for shard in shards:
                _expect(key, value, shard, fmt, found)
            if fmt == "safetensors":
                _check_placement(key, value, path, found.name, weight_map)
            return Checkpoint(path, tuple(shards), fmt, weight_map)
    expected = ", ".join(name for name, _ in HF_LAYOUTS)
    raise ConfigError(key, value, f"is a directory holding no checkpoint: expected one of {expected}")


def _layouts(key: str, value: str, directory: Path) -> tuple[tuple[str, str], ...]:
    """Where to look for a directory's weights: the file its config.json names
    (`transformers_weights`, which transformers reads first), else HF_LAYOUTS."""
    if not (directory / "config.json").is_file():  # none, or a FIFO that would block the read
        return HF_LAYOUTS
    try:
        named = json.loads((directory / "config.json").read_text()).get("transformers_weights")
    except (OSError, ValueError, AttributeError):
        return HF_LAYOUTS
    if not isinstance(named, str):
        return HF_LAYOUTS
    if not named or named != Path(named).name or named in (".", ".."):
        raise ConfigError(key, value, f"has a config.json whose transformers_weights names {named!r}: not a file in it")
    fmt = "safetensors" if ".safetensors" in named else "torch"
    return ((named, fmt),)


def check_pretrained_dir(key: str, value: str, path: Path) -> None:
    """A directory as `save_pretrained` writes it, named by `key`: one, holding
    its config.json (its weights are `resolve_checkpoint`'s to check)."""
    if not str(value).strip():
        raise ConfigError(key, value, "a save_pretrained directory is required: give its path")
    if not path.exists():
        raise ConfigError(key, value, f"no such directory ({path})")
    if not path.is_dir():
        raise ConfigError(key, value, "is a file; give the save_pretrained directory (the folder holding config.json)")
    config = path / "config.json"
    for name in ("config.json", *(name for name, _ in HF_LAYOUTS)):  # what transformers would open and block on
        if (path / name).exists() and not (path / name).is_file():
            raise ConfigError(key, value, f"holds {name}, which is {_special(path / name)}, not a regular file")
    if not config.is_file():
        raise ConfigError(key, value, f"holds no config.json ({config}): not a save_pretrained directory")


def holds_checkpoint(path: Path) -> bool:
    """Does a directory hold a checkpoint as save_pretrained writes one?"""
    return path.is_dir() and any((path / name).is_file() for name, _ in HF_LAYOUTS)


def _weight_map(key: str, value: str, index: Path) -> dict[str, str]:
    """An index's tensor -> shard map, every shard a file inside the index's directory."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
        raise ConfigError(key, value, f"holds {index.name}, which is not a JSON index ({exc})") from None
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
        raise ConfigError(key, value, f"holds {index.name}, whose weight_map does not map tensor names to shard files")
    for shard in dict.fromkeys(weight_map.values()):
        # By name: a shard is an entry of the directory (one that is a link, as a
        # hub cache's are, is read and keyed by what it holds), never a path out of it.
        if not shard or shard != Path(shard).name or shard in (".", ".."):
            raise ConfigError(
                key,
                value,
                f"holds {index.name}, whose weight_map names {shard!r}: a shard must be a file in that directory",
            )
    return weight_map


def _missing(path: Path) -> str:
    """Why a path names nothing: not there, a link to nothing, or a link loop."""
    if not os.path.islink(path):
        return f"no such file or directory ({path})"
    try:
        path.stat()
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return f"is a link loop ({path} -> {os.readlink(path)} ... leads back to itself)"
    return f"is a link to {os.readlink(path)}, which does not exist"


def _check_placement(key: str, value: str, directory: Path, index: str, weight_map: Mapping[str, str]) -> None:
    """Each tensor in the shard its index places it in (their headers alone
    are read): a loader trusting the index finds it missing, one reading the
    shards finds it elsewhere."""
    held: dict[str, set[str]] = {}
    for shard in dict.fromkeys(weight_map.values()):
        with open(directory / shard, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            held[shard] = {name for name in json.loads(f.read(length)) if name != "__metadata__"}
    for name, shard in weight_map.items():
        if name not in held[shard]:
            elsewhere = next((other for other, names in held.items() if name in names), None)
            where = f"; {elsewhere} holds it" if elsewhere else "; no shard holds it"
            raise ConfigError(key, value, f"holds {index}, which places {name} in {shard}, which lacks it{where}")


def _special(path: Path) -> str:
    """What a path that is neither a regular file nor a directory is."""
    mode = path.stat().st_mode
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))  # fmt: skip
    for test, what in kinds:
        if test(mode):
            return what
    return "something else"


def _expect(key: str, value: str, file: Path, fmt: str, index: Path | None = None) -> str:
    if file.exists() and not file.is_file():
        raise ConfigError(key, value, f"holds {file.name}, which is {_special(file)}, not a checkpoint file")
    if not file.is_file():
        tensors = "" if index is None else f" ({index.name} maps tensors to it)"
        raise ConfigError(key, value, f"lacks the shard {file.name}{tensors}")
    found = _file_format(key, value, file)
    if found != fmt:
        raise ConfigError(key, value, f"holds {file.name}, which is a {found} file, not {fmt}")
    return found


def _file_format(key: str, value: str, file: Path) -> str:
    where = "" if file.name == Path(value).name else f"{file.name} "
    try:
        return checkpoint_format(file)
    except OSError as exc:
        raise ConfigError(key, value, f"{where or ''}cannot be read ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise ConfigError(key, value, f"{'holds ' + file.name + ', which ' if where else ''}is {exc}") from None
