"""sidecar.core.hashing: the digest is the file's whatever the chunking, and a paced hash sleeps after each chunk."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import xxhash

from sidecar.core import hashing


def test_digests_match_the_libraries_over_whole_and_partial_chunks(tmp_path: Path) -> None:
    data = os.urandom(hashing.CHUNK * 2 + 12345)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    assert hashing.file_digest(path) == xxhash.xxh3_128(data).hexdigest()
    assert hashing.file_digest(path, hashing.Algorithm.SHA256) == hashlib.sha256(data).hexdigest()


def test_a_paced_hash_gives_the_same_digest_and_sleeps_after_each_chunk(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(hashing.CHUNK * 3))
    plain = hashing.digest_and_sync(path)
    started = time.perf_counter()
    paced = hashing.digest_and_sync(path, pause=0.05)
    assert paced == plain
    assert time.perf_counter() - started >= 3 * 0.05
