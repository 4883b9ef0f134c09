"""weights.WeightsIdentifier: the model file's checksum, cached across restarts, and its fallback."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import xxhash
from structlog.testing import capture_logs

from sidecar.core import hashing
from sidecar.observe import weights


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "models" / "model.gguf"
    path.parent.mkdir()
    path.write_bytes(os.urandom(3 << 20))
    return path


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    path = tmp_path / "slots"
    path.mkdir()
    return path


async def test_the_checksum_is_xxh3_128_of_the_whole_file(model: Path, cache_dir: Path) -> None:
    found = await weights.WeightsIdentifier(cache_dir).identify(str(model))
    assert found == "xxh3-128:" + xxhash.xxh3_128_hexdigest(model.read_bytes())


async def test_cached_in_memory_and_across_a_restart(model: Path, cache_dir: Path) -> None:
    first = weights.WeightsIdentifier(cache_dir)
    value = await first.identify(str(model))
    assert await first.identify(str(model)) == value
    assert first.hashed == 1
    restarted = weights.WeightsIdentifier(cache_dir)  # a new process: only the cache file is left
    assert await restarted.identify(str(model)) == value
    assert restarted.hashed == 0
    assert (cache_dir / weights.CACHE_NAME).stat().st_mode & 0o007 == 0  # like the snapshots: not world-readable


async def test_other_weights_written_in_place_are_hashed_again(model: Path, cache_dir: Path) -> None:
    ident = weights.WeightsIdentifier(cache_dir)
    before = await ident.identify(str(model))
    st = model.stat()
    with model.open("r+b") as fh:  # a fine-tune of the same shape: same size, same inode
        fh.seek(st.st_size // 2)
        fh.write(os.urandom(16))
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns))  # even with the old mtime put back (ctime still moves)
    assert model.stat().st_size == st.st_size
    after = await weights.WeightsIdentifier(cache_dir).identify(str(model))
    assert after is not None
    assert after != before
    assert after == "xxh3-128:" + xxhash.xxh3_128_hexdigest(model.read_bytes())


async def test_an_unreadable_model_file_is_said_once_and_gives_none(tmp_path: Path, cache_dir: Path) -> None:
    ident = weights.WeightsIdentifier(cache_dir)
    missing = str(tmp_path / "elsewhere" / "model.gguf")  # the server's path, not mounted into the sidecar
    with capture_logs() as logs:
        assert await ident.identify(missing) is None
        assert await ident.identify(missing) is None
    said = [entry for entry in logs if entry["event"] == "model_file_unreadable"]
    assert len(said) == 1
    assert said[0]["model_path"] == missing
    assert "read-only" in said[0]["hint"]
    assert "path, size and parameter count" in said[0]["effect"]


async def test_a_damaged_cache_file_is_only_a_cache(model: Path, cache_dir: Path) -> None:
    (cache_dir / weights.CACHE_NAME).write_text("{not json")
    ident = weights.WeightsIdentifier(cache_dir)
    assert await ident.identify(str(model)) == "xxh3-128:" + xxhash.xxh3_128_hexdigest(model.read_bytes())
    assert ident.hashed == 1


async def test_a_device_as_model_path_is_refused_unread_and_said(cache_dir: Path) -> None:
    ident = weights.WeightsIdentifier(cache_dir)
    with capture_logs() as logs:
        async with asyncio.timeout(5):  # /dev/zero, hashed, never ends
            assert await ident.identify("/dev/zero") is None
    said = [entry for entry in logs if entry["event"] == "model_file_refused"]
    assert len(said) == 1, logs
    assert "a character device, not a regular file" in said[0]["error"]
    assert "polling and serving go on" in said[0]["effect"]
    assert ident.hashed == 0


async def test_a_fifo_as_model_path_is_refused_without_waiting_for_a_writer(tmp_path: Path, cache_dir: Path) -> None:
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    ident = weights.WeightsIdentifier(cache_dir)
    with capture_logs() as logs:
        async with asyncio.timeout(5):  # an open for reading blocks until a writer comes
            assert await ident.identify(str(fifo)) is None
    said = [entry for entry in logs if entry["event"] == "model_file_refused"]
    assert len(said) == 1, logs
    assert "a FIFO, not a regular file" in said[0]["error"]


async def test_a_link_to_the_model_file_is_followed(model: Path, cache_dir: Path) -> None:
    link = model.with_name("current.gguf")  # model caches are made of links to blobs
    link.symlink_to(model)
    found = await weights.WeightsIdentifier(cache_dir).identify(str(link))
    assert found == "xxh3-128:" + xxhash.xxh3_128_hexdigest(model.read_bytes())


async def test_a_hash_past_its_deadline_is_given_up_and_said(
    model: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hashing, "deadline_for", lambda size: -1.0)  # a disk far below the floor rate
    ident = weights.WeightsIdentifier(cache_dir)
    with capture_logs() as logs:
        assert await ident.identify(str(model)) is None
    said = [entry for entry in logs if entry["event"] == "model_file_refused"]
    assert [entry["reason"] for entry in said] == ["overdue"], logs
    assert "deadline" in said[0]["error"]
    assert ident.hashed == 0


async def test_a_read_stuck_in_its_thread_is_left_behind_and_not_started_twice(
    model: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    calls: list[int] = []
    real = hashing.fd_digest

    def stuck(fd: int, algorithm: hashing.Algorithm, **kwargs: Any) -> str:
        calls.append(fd)
        release.wait(timeout=30)  # a read on a hung network mount
        return real(fd, algorithm, **kwargs | {"deadline": None})

    monkeypatch.setattr(hashing, "fd_digest", stuck)
    monkeypatch.setattr(hashing, "deadline_for", lambda size: 0.0)
    monkeypatch.setattr(weights, "SLACK", 0.2)
    ident = weights.WeightsIdentifier(cache_dir)
    try:
        with capture_logs() as logs:
            async with asyncio.timeout(5):
                assert await ident.identify(str(model)) is None
                assert await ident.identify(str(model)) is None  # the first thread still reads
        assert len(calls) == 1
        assert [entry["reason"] for entry in logs if entry["event"] == "model_file_refused"] == ["overdue"]
    finally:
        release.set()
    async with asyncio.timeout(5):
        while ident.hashed == 0:  # the stuck thread ends, and its result lands in the cache
            await asyncio.sleep(0.01)
    assert await ident.identify(str(model)) == "xxh3-128:" + xxhash.xxh3_128_hexdigest(model.read_bytes())
    assert len(calls) == 1
