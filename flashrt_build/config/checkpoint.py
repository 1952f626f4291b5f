"""Checkpoint files, looked at before any work and without torch: is it a
safetensors file whose header and data agree (not truncated), or a torch
checkpoint (a zip archive, or the legacy pickle format)? What is wrong is a
ConfigError naming the key and the file."""

from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path

from ..errors import ConfigError

# Bytes per element of safetensors' dtypes.
_ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8, "C64": 8,
}  # fmt: skip
_MAX_HEADER = 100 << 20  # safetensors' own limit


def checkpoint_format(path: Path) -> str:
    """ "safetensors" or "torch" for a file that is one, complete; else a ValueError saying why not."""
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
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"a safetensors file whose header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError("a safetensors file whose header is not a JSON object")
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, stop = entry["data_offsets"]
            count = 1
            for n in entry["shape"]:
                count *= int(n)
            itemsize = _ITEMSIZE.get(entry["dtype"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"a safetensors file whose header entry for {name!r} is malformed") from None
        if not 0 <= begin <= stop or (itemsize is not None and stop - begin != count * itemsize):
            raise ValueError(f"a safetensors file whose header entry for {name!r} disagrees with its shape")
        end = max(end, stop)
    if end > data_size:
        raise ValueError(
            f"a truncated safetensors file: its header places tensor data up to byte {end} of the data, "
            f"which holds {data_size} bytes"
        )


def check_checkpoint_file(key: str, value: str, path: Path) -> str:
    """The format of a checkpoint file the build will read, or a ConfigError
    naming `key`: missing, a directory, unreadable, or not a complete checkpoint."""
    if not path.exists():
        raise ConfigError(key, value, f"no such file ({path})")
    if not path.is_file():
        raise ConfigError(key, value, f"is a directory, not a file ({path})")
    try:
        return checkpoint_format(path)
    except OSError as exc:
        raise ConfigError(key, value, f"cannot be read ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise ConfigError(key, value, f"is {exc}") from None
