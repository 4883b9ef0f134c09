"""The identity of the model's weights: a checksum of the model file.

Invariants and trade-offs: docs/modules.md, `sidecar/observe/weights.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import secrets
import time
from pathlib import Path
from typing import Any

import structlog

from sidecar.core import hashing, safeio, tasks

log = structlog.get_logger("sidecar.weights")
CACHE_NAME = ".llama-kv-sidecar.weights.json"
CACHE_KEEP = 8
"""Model files remembered in the cache file (a few models served in turn)."""
SLACK = 2.0
"""Seconds the poll waits past a hash's own deadline before it leaves the worker thread behind."""
FALLBACK = (
    "snapshots are matched to the model by path, size and parameter count only: a model file rewritten "
    "with other weights of the same shape would not be noticed; polling and serving go on"
)

_Key = tuple[str, int, int, int, int, int]


@dataclasses.dataclass(slots=True)
class _Job:
    """One identification in a worker thread: the thread moves ``deadline`` once it knows the file's size."""

    deadline: float
    """``time.monotonic()`` at which the hash gives up (at first: the time the open and ``fstat`` may take)."""


class WeightsIdentifier:
    """``await identify(path)`` → ``xxh3-128:<hex>`` of the model file, or None if it is unreadable."""

    def __init__(self, cache_dir: Path) -> None:
        self._cache_path = cache_dir / CACHE_NAME
        self._cache: dict[str, dict[str, Any]] | None = None
        self._said: set[str] = set()
        self._lock = asyncio.Lock()
        self._stuck: asyncio.Task[str | None] | None = None
        """A hash the poll stopped waiting for, while its thread still runs."""
        self.hashed = 0
        """Model files hashed (not found in the cache) by this process."""

    async def identify(self, model_path: str) -> str | None:
        async with self._lock:  # one hash at a time; a second caller then finds it cached
            if self._stuck is not None and not self._stuck.done():
                return None  # its thread still reads: not a second one beside it
            job = _Job(deadline=time.monotonic() + hashing.GRACE)
            task = tasks.watch(
                asyncio.create_task(asyncio.to_thread(self._identify, model_path, job), name="weights-hash"),
                effect="the model's weights are not identified by checksum",
            )
            while not task.done():
                left = job.deadline + SLACK - time.monotonic()
                if left <= 0:
                    self._stuck = task
                    self._refused(
                        model_path,
                        "overdue",
                        f"reading it did not end within its deadline ({hashing.deadline_for(0):.0f} s plus "
                        f"one per {hashing.FLOOR_RATE >> 20} MiB): a hung disk or network mount",
                    )
                    return None
                await asyncio.wait({task}, timeout=min(left, 1.0))
            return task.result()

    def _identify(self, model_path: str, job: _Job) -> str | None:
        try:
            fd, st = safeio.open_regular(Path(model_path), follow=True)
        except safeio.Refused as exc:
            self._refused(model_path, exc.reason, str(exc))
            return None
        except OSError as exc:
            self._unreadable(model_path, exc)
            return None
        try:
            return self._identify_open(model_path, fd, st, job)
        finally:
            os.close(fd)

    def _identify_open(self, model_path: str, fd: int, st: os.stat_result, job: _Job) -> str | None:
        key = _key(model_path, st)
        cache = self._load()
        entry = cache.get(model_path)
        if entry is not None and tuple(entry.get("key", ())) == key:
            return str(entry["weights"])
        started = time.perf_counter()
        job.deadline = time.monotonic() + hashing.deadline_for(st.st_size)
        try:
            digest = hashing.fd_digest(fd, hashing.CURRENT, limit=st.st_size, deadline=job.deadline)
            after = _key(model_path, os.fstat(fd))
        except hashing.Overdue as exc:
            self._refused(model_path, "overdue", str(exc))
            return None
        except OSError as exc:
            self._unreadable(model_path, exc)
            return None
        if after != key:
            log.warning("model_file_changed_while_hashing", model_path=model_path, effect="hashed again next time")
            return None
        self.hashed += 1
        weights = f"{hashing.CURRENT}:{digest}"
        self._said.discard(model_path)
        cache.pop(model_path, None)
        cache[model_path] = {"key": list(key), "weights": weights}
        while len(cache) > CACHE_KEEP:
            cache.pop(next(iter(cache)))
        self._save(cache)
        seconds = time.perf_counter() - started
        log.info("model_file_hashed", model_path=model_path, weights=weights, bytes=key[1], seconds=round(seconds, 3))
        return weights

    def _unreadable(self, model_path: str, exc: OSError) -> None:
        if model_path in self._said:
            return
        self._said.add(model_path)
        log.warning(
            "model_file_unreadable",
            model_path=model_path,
            error=f"{type(exc).__name__}: {exc.strerror or exc}",
            effect=FALLBACK,
            hint="let the sidecar read the model file at the path llama-server reports (mount the model "
            "directory read-only into the sidecar at the same path)",
        )

    def _refused(self, model_path: str, reason: str, what: str) -> None:
        if model_path in self._said:
            return
        self._said.add(model_path)
        log.warning(
            "model_file_refused",
            model_path=model_path,
            reason=reason,
            error=what,
            effect=FALLBACK,
            hint="start llama-server with -m naming the model's GGUF file (a regular file on a working disk)"
            if reason != "overdue"
            else "check the disk or mount that holds the model file; the checksum is tried again when "
            "llama-server restarts",
        )

    def _load(self) -> dict[str, dict[str, Any]]:
        if self._cache is None:
            try:
                raw = json.loads(self._cache_path.read_text())
                self._cache = {str(k): v for k, v in raw.items() if isinstance(v, dict)}
            except (OSError, ValueError, AttributeError):
                self._cache = {}  # absent or damaged: it is only a cache
        return self._cache

    def _save(self, cache: dict[str, dict[str, Any]]) -> None:
        temp = self._cache_path.with_name(f".tmp-{secrets.token_hex(6)}.json")
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
            with os.fdopen(fd, "w") as fh:
                fh.write(json.dumps(cache, indent=1) + "\n")
            os.replace(temp, self._cache_path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                temp.unlink()
            log.warning("weights_cache_unwritable", path=str(self._cache_path), error=str(exc))


def _key(model_path: str, st: os.stat_result) -> _Key:
    """What changes whenever the file's content may have."""
    return (model_path, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_dev, st.st_ino)
