"""The seam between the shared store's logic and the storage that holds it.

:class:`ObjectStore` is what the uploader, downloader, catalog and gc need:
create-only writes (a key is written once; a second writer learns that it
exists and changes nothing), streamed reads, listing and deletion. Two
implementations: ``s3store`` (any S3 API, via aiobotocore) and
``filestore`` (a directory on a shared filesystem). Every failure is an
``errors.SharedStoreError`` naming its operation.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
from collections.abc import AsyncIterator, Coroutine, Iterable
from pathlib import Path
from typing import Protocol

from sidecar.core import errors, outcomes

PART_BYTES = 8 << 20
"""Multipart part size and read chunk: 8 MiB (S3 allows 10,000 parts: objects up to 80 GB)."""


class Written(enum.StrEnum):
    CREATED = "created"
    EXISTED = "existed"
    """Another writer (or an earlier attempt) created the key first; nothing was changed."""


@dataclasses.dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str
    size: int
    modified: float
    """Unix time the object was written."""


class ObjectStore(Protocol):
    def describe(self) -> str:
        """Where the store is, without credentials."""
        ...

    async def put_file(self, key: str, path: Path) -> Written:
        """Create ``key`` from the file at ``path``, streamed (multipart above one part)."""
        ...

    async def put_bytes(self, key: str, data: bytes) -> Written:
        """Create ``key`` holding ``data``."""
        ...

    def stream(self, key: str) -> AsyncIterator[bytes]:
        """The object's bytes in chunks; SharedStoreError(missing=True) if there is no such key."""
        ...

    async def get_bytes(self, key: str, *, limit: int) -> bytes:
        """The whole object if it holds at most ``limit`` bytes; ``errors.SharedObjectRefused`` (oversized)
        if it holds more, without reading more than ``limit + 1`` bytes."""
        ...

    async def head(self, key: str) -> ObjectInfo | None:
        """The object's size and time, None if there is no such key."""
        ...

    async def list_objects(self, prefix: str) -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix``."""
        ...

    async def delete(self, keys: list[str]) -> None:
        """Delete ``keys``; keys already gone are not an error."""
        ...

    async def close(self) -> None: ...


def bounded(key: str, data: bytes, limit: int) -> bytes:
    """``data`` read with a bound of ``limit + 1`` bytes, refused if it reached past ``limit``."""
    if len(data) > limit:
        raise errors.SharedObjectRefused(
            f"{key} holds more than {limit} bytes: refused without reading the rest",
            operation=outcomes.SharedOperation.GET,
            reason=outcomes.SharedRefusal.OVERSIZED,
        )
    return data


async def all_done(calls: Iterable[Coroutine[object, object, None]]) -> None:
    """Run ``calls`` at once and wait for every one; then raise the first failure, if any (none is left running)."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
