"""A manifest's record of a file: whole-file sha256 plus per-chunk digests that
a load checks on every core. Pure logic on real files; compiles nothing."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from flashrt_build.runtime import hashing as mf
from flashrt_build.runtime.hashing import altered_digest, chunk_spans, file_record


def write(path: Path, size: int, seed: int = 0) -> Path:
    path.write_bytes(bytes((i * 31 + seed) % 251 for i in range(size)))
    return path


def test_spans_cover_every_byte_once() -> None:
    assert chunk_spans(10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert chunk_spans(8, 4) == [(0, 4), (4, 4)]
    assert chunk_spans(0, 4) == [(0, 0)]  # an empty file still has one (empty) digest


@pytest.mark.parametrize("size", [0, 1000, 4096, 4097, 10_000])
def test_a_record_holds_the_files_digest_and_each_chunks(tmp_path: Path, size: int) -> None:
    path = write(tmp_path / "f", size)
    data = path.read_bytes()
    record = file_record(path, chunk_bytes=4096)
    assert record["sha256"] == hashlib.sha256(data).hexdigest()
    assert record["bytes"] == size and record["chunk_bytes"] == 4096
    expected = [hashlib.sha256(data[o : o + n]).hexdigest() for o, n in chunk_spans(size, 4096)]
    assert record["chunk_sha256"] == expected
    assert altered_digest(path, record) is None


def test_one_flipped_byte_in_any_chunk_is_found_and_the_whole_digest_named(tmp_path: Path) -> None:
    path = write(tmp_path / "f", 10_000)
    record = file_record(path, chunk_bytes=4096)
    for offset in (0, 4095, 4096, 9_999):  # first, chunk edges, last byte
        data = bytearray(path.read_bytes())
        data[offset] ^= 0x01
        altered = tmp_path / f"altered{offset}"
        altered.write_bytes(bytes(data))
        assert altered_digest(altered, record) == hashlib.sha256(bytes(data)).hexdigest()


def test_a_truncated_or_extended_file_is_altered(tmp_path: Path) -> None:
    path = write(tmp_path / "f", 10_000)
    record = file_record(path, chunk_bytes=4096)
    data = path.read_bytes()
    for changed in (data[:-1], data + b"\0", data[:8192]):  # the last one ends on a chunk edge
        (tmp_path / "g").write_bytes(changed)
        assert altered_digest(tmp_path / "g", record) == hashlib.sha256(changed).hexdigest()


def test_a_record_without_chunks_is_checked_by_the_whole_digest(tmp_path: Path) -> None:
    # Manifests written before chunk digests existed, and a sidecar replaced
    # by hand with only its sha256 updated: the whole-file digest decides.
    path = write(tmp_path / "f", 10_000)
    old = {"sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "bytes": 10_000}
    assert altered_digest(path, old) is None
    stale = {**file_record(write(tmp_path / "other", 10_000, seed=1), chunk_bytes=4096), "sha256": old["sha256"]}
    assert altered_digest(path, stale) is None
    assert altered_digest(path, {**old, "sha256": "0" * 64}) == old["sha256"]
    # Chunks that match decide: the whole file is hashed only to name a mismatch.
    assert altered_digest(path, {**file_record(path, chunk_bytes=4096), "sha256": "0" * 64}) is None


def test_chunks_are_hashed_on_several_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    path = write(tmp_path / "f", 16 * 1024)
    record = file_record(path, chunk_bytes=1024)
    threads: set[int] = set()
    barrier = threading.Barrier(2, timeout=10)
    original = mf.range_sha256

    def spy(p: Path, span: tuple[int, int]) -> str:
        threads.add(threading.get_ident())
        if span[0] < 2048:
            barrier.wait()  # the first two chunks meet: they run at once, or this times out
        return original(p, span)

    monkeypatch.setattr(mf, "range_sha256", spy)
    monkeypatch.setattr(mf, "hashing_threads", lambda: 4)
    assert altered_digest(path, record) is None
    assert len(threads) >= 2
