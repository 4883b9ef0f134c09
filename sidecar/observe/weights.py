"""The identity of the model's weights: a checksum of the model file.

Path, size and parameter count describe the model's shape: a fine-tune
copied over the same file keeps all three, and its KV cache restores
without an error yet changes every answer. The checksum of the file tells
the weights apart. The sidecar reads the file at the path llama-server
reports in /props, so it must see the model at that same path (mounted
read-only beside the slot dir in a container). When it cannot, it says so
once and falls back to path, size and parameter count.

Hashing GBs takes seconds even at xxh3 speed from a cold disk, so results
are cached by path, size, mtime, ctime, device and inode, in memory and in
``.llama-kv-sidecar.weights.json`` in the slot dir, which survives a restart
of the sidecar. Any write to the model file changes its mtime or ctime and
forces a new hash. The hash runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import time
from pathlib import Path
from typing import Any

import structlog

from sidecar.core import hashing

log = structlog.get_logger("sidecar.weights")
CACHE_NAME = ".llama-kv-sidecar.weights.json"
CACHE_KEEP = 8
"""Model files remembered in the cache file (a few models served in turn)."""

_Key = tuple[str, int, int, int, int, int]


class WeightsIdentifier:
    """``await identify(path)`` → ``xxh3-128:<hex>`` of the model file, or None if it is unreadable."""

    def __init__(self, cache_dir: Path) -> None:
        self._cache_path = cache_dir / CACHE_NAME
        self._cache: dict[str, dict[str, Any]] | None = None
        self._said: set[str] = set()
        self._lock = asyncio.Lock()
        self.hashed = 0
        """Model files hashed (not found in the cache) by this process."""

    async def identify(self, model_path: str) -> str | None:
        async with self._lock:  # one hash at a time; a second caller then finds it cached
            return await asyncio.to_thread(self._identify, model_path)

    def _identify(self, model_path: str) -> str | None:
        path = Path(model_path)
        try:
            key = _key(path)
        except OSError as exc:
            self._unreadable(model_path, exc)
            return None
        cache = self._load()
        entry = cache.get(model_path)
        if entry is not None and tuple(entry.get("key", ())) == key:
            return str(entry["weights"])
        started = time.perf_counter()
        try:
            digest = hashing.file_digest(path)
            after = _key(path)
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
            effect="snapshots are matched to the model by path, size and parameter count only: a model "
            "file rewritten with other weights of the same shape would not be noticed",
            hint="let the sidecar read the model file at the path llama-server reports (mount the model "
            "directory read-only into the sidecar at the same path)",
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


def _key(path: Path) -> _Key:
    """What changes whenever the file's content may have: raises OSError if it cannot be read."""
    st = os.stat(path)
    with path.open("rb") as fh:  # readable, not just visible
        fh.read(1)
    return (str(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_dev, st.st_ino)
