"""The digests a build remembers by `stat`: a file whose bytes changed is read
again, even where its size and mtime were kept."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from flashrt_build.cache.digests import DigestCache


def test_a_same_size_edit_that_keeps_the_mtime_is_read_again(tmp_path: Path) -> None:
    """`cp -p`, `rsync -a --inplace`, `touch -r`: the mtime is the old one,
    the ctime (the kernel's, which no user sets) is not."""
    shard = tmp_path / "model.safetensors"
    shard.write_bytes(b"A" * 4096)
    kept = shard.stat()
    store = tmp_path / ".store"
    store.mkdir()
    digests = DigestCache(store)
    later = time.time_ns() + 10**10  # hashed well after any change: trusted, not racy
    digests.remember(shard, hashlib.sha256(shard.read_bytes()).hexdigest(), kept, at_ns=later)
    digests.save()
    assert DigestCache(store).known(shard) == hashlib.sha256(b"A" * 4096).hexdigest()
    with open(shard, "r+b") as f:  # one byte, in place: size and inode as they were
        f.seek(100)
        f.write(b"B")
    os.utime(shard, ns=(kept.st_atime_ns, kept.st_mtime_ns))  # and the mtime put back
    assert shard.stat().st_mtime_ns == kept.st_mtime_ns and shard.stat().st_size == kept.st_size
    fresh = DigestCache(store)
    assert fresh.known(shard) is None
    assert fresh.sha256(shard) == hashlib.sha256(shard.read_bytes()).hexdigest()
