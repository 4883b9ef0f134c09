"""The shared store on a shared filesystem (``file:///PATH``: NFS, CephFS, EFS, a local disk for tests).

Keys map to paths under the directory. A write goes to a temporary name in
the target directory, is fsynced, and is published with ``os.link``, which
fails when the name exists: the create-only write of the S3 store, atomic on
POSIX filesystems (NFS included). Blocking calls run in worker threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import secrets
import shutil
import stat
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import BinaryIO

from sidecar.core import errors, location, outcomes
from sidecar.shared import objstore

TEMP_PREFIX = ".tmp-"


class FileStore:
    def __init__(self, where: location.Location) -> None:
        self._where = where
        self.root = Path(where.prefix)

    def describe(self) -> str:
        return self._where.describe()

    async def close(self) -> None:
        return None

    def _path(self, key: str) -> Path:
        parts = [p for p in key.split("/") if p]
        if not parts or any(p in (".", "..") or p.startswith(TEMP_PREFIX) for p in parts):
            raise errors.SharedStoreError(
                f"{key!r} is not a key of the shared store", operation=outcomes.SharedOperation.PUT
            )
        return self.root.joinpath(*parts)

    async def put_file(self, key: str, path: Path) -> objstore.Written:
        return await asyncio.to_thread(self._publish, key, lambda fh: _copy(path, fh))

    async def put_bytes(self, key: str, data: bytes) -> objstore.Written:
        return await asyncio.to_thread(self._publish, key, lambda fh: fh.write(data))

    def _publish(self, key: str, write: Callable[[BinaryIO], object]) -> objstore.Written:
        target = self._path(key)
        temp = target.with_name(f"{TEMP_PREFIX}{secrets.token_hex(6)}")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with temp.open("wb") as fh:
                write(fh)
                fh.flush()
                os.fsync(fh.fileno())
            try:
                os.link(temp, target)
            except FileExistsError:
                return objstore.Written.EXISTED
            _sync_dir(target.parent)
        except OSError as exc:
            raise errors.SharedStoreError(f"writing {key}: {exc}", operation=outcomes.SharedOperation.PUT) from exc
        finally:
            with contextlib.suppress(OSError):
                temp.unlink()
        return objstore.Written.CREATED

    async def stream(self, key: str) -> AsyncIterator[bytes]:
        try:
            fh = await asyncio.to_thread(self._path(key).open, "rb")
        except FileNotFoundError as exc:
            raise errors.SharedStoreError(
                f"{key} is not in {self.root}", operation=outcomes.SharedOperation.GET, missing=True
            ) from exc
        except OSError as exc:
            raise errors.SharedStoreError(f"reading {key}: {exc}", operation=outcomes.SharedOperation.GET) from exc
        try:
            while chunk := await asyncio.to_thread(fh.read, 1 << 20):
                yield chunk
        except OSError as exc:
            raise errors.SharedStoreError(f"reading {key}: {exc}", operation=outcomes.SharedOperation.GET) from exc
        finally:
            fh.close()

    async def get_bytes(self, key: str, *, limit: int) -> bytes:
        """The file's first ``limit + 1`` bytes at most: a larger file is refused, never read whole."""
        try:
            data = await asyncio.to_thread(_read_head, self._path(key), limit + 1)
        except FileNotFoundError as exc:
            raise errors.SharedStoreError(
                f"{key} is not in {self.root}", operation=outcomes.SharedOperation.GET, missing=True
            ) from exc
        except OSError as exc:
            raise errors.SharedStoreError(f"reading {key}: {exc}", operation=outcomes.SharedOperation.GET) from exc
        return objstore.bounded(key, data, limit)

    async def head(self, key: str) -> objstore.ObjectInfo | None:
        try:
            st = await asyncio.to_thread(os.stat, self._path(key))
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise errors.SharedStoreError(f"reading {key}: {exc}", operation=outcomes.SharedOperation.GET) from exc
        return objstore.ObjectInfo(key, st.st_size, st.st_mtime)

    async def list_objects(self, prefix: str) -> list[objstore.ObjectInfo]:
        return await asyncio.to_thread(self._list, prefix)

    def _list(self, prefix: str) -> list[objstore.ObjectInfo]:
        found: list[objstore.ObjectInfo] = []
        base = self.root / prefix.rsplit("/", 1)[0] if "/" in prefix else self.root
        try:
            for dirpath, _dirs, files in os.walk(base):
                for name in files:
                    if name.startswith(TEMP_PREFIX):
                        continue
                    full = Path(dirpath) / name
                    key = full.relative_to(self.root).as_posix()
                    if key.startswith(prefix):
                        with contextlib.suppress(FileNotFoundError):
                            st = full.stat()
                            found.append(objstore.ObjectInfo(key, st.st_size, st.st_mtime))
        except OSError as exc:
            raise errors.SharedStoreError(f"listing {prefix}: {exc}", operation=outcomes.SharedOperation.LIST) from exc
        return sorted(found, key=lambda info: info.key)

    async def delete(self, keys: list[str]) -> None:
        await asyncio.to_thread(self._delete, keys)

    def _delete(self, keys: list[str]) -> None:
        for key in keys:
            try:
                self._path(key).unlink()
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise errors.SharedStoreError(
                    f"deleting {key}: {exc}", operation=outcomes.SharedOperation.DELETE
                ) from exc


def _read_head(path: Path, size: int) -> bytes:
    """Up to ``size`` bytes of a regular file (a FIFO or device under the store's root is refused)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        return os.read(fd, size)
    finally:
        os.close(fd)


def _copy(path: Path, fh: BinaryIO) -> None:
    with path.open("rb") as src:
        shutil.copyfileobj(src, fh, objstore.PART_BYTES)


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
