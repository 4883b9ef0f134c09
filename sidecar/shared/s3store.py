"""The shared store on an S3 API (AWS S3, Ceph RGW, MinIO, SeaweedFS, R2, ...), via aiobotocore.

aiobotocore was chosen by measurement over obstore (``bench/shared_store.py``):
faster both ways on a 200 MiB object, a flat memory profile while streaming,
and ``If-None-Match: *`` on CompleteMultipartUpload too (obstore's create
mode sends a single PUT with the whole object in memory).

Every write is a conditional create (``If-None-Match: *``): a 412 means
another node created the key first. Multipart uploads read one part at a
time from disk in a worker thread; a failed one is aborted. Servers that
ignore the condition on CompleteMultipartUpload (Ceph RGW 16) overwrite an
object with the same bytes, since keys are content-addressed.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import aiobotocore.config
import aiobotocore.session
import botocore.exceptions

from sidecar.core import errors, location, outcomes, tasks
from sidecar.shared import objstore

if TYPE_CHECKING:
    from types_aiobotocore_s3 import S3Client
    from types_aiobotocore_s3.type_defs import CompletedPartTypeDef

CONNECT_TIMEOUT = 5.0
READ_TIMEOUT = 60.0
_TRANSPORT = (botocore.exceptions.BotoCoreError, OSError, asyncio.TimeoutError)
_ABSENT = ("404", "NoSuchKey", "NotFound")
_TAKEN = ("412", "PreconditionFailed")
_EMPTY_RANGE = ("416", "InvalidRange")


class S3Store:
    """An S3 bucket and key prefix; call :meth:`close` when done."""

    def __init__(self, where: location.Location) -> None:
        self._where = where
        self._bucket = where.bucket
        self._exit = contextlib.AsyncExitStack()
        self._client: S3Client | None = None
        self._opening = asyncio.Lock()

    def describe(self) -> str:
        return self._where.describe()

    async def _s3(self) -> S3Client:
        async with self._opening:
            if self._client is None:
                session = aiobotocore.session.get_session()
                cfg = aiobotocore.config.AioConfig(
                    connect_timeout=CONNECT_TIMEOUT,
                    read_timeout=READ_TIMEOUT,
                    retries={"max_attempts": 2, "mode": "standard"},
                    s3={"addressing_style": "path" if self._where.endpoint else "auto"},
                    request_checksum_calculation="when_required",
                    response_checksum_validation="when_required",
                )
                self._client = await self._exit.enter_async_context(
                    session.create_client(
                        "s3",
                        endpoint_url=self._where.endpoint,
                        region_name=self._where.region,
                        aws_access_key_id=self._where.access_key_id,
                        aws_secret_access_key=self._where.secret_access_key,
                        aws_session_token=self._where.session_token,
                        config=cfg,
                    )
                )
            return self._client

    async def close(self) -> None:
        await self._exit.aclose()
        self._client = None

    async def put_bytes(self, key: str, data: bytes) -> objstore.Written:
        s3 = await self._s3()
        try:
            await s3.put_object(Bucket=self._bucket, Key=key, Body=data, IfNoneMatch="*")
        except botocore.exceptions.ClientError as exc:
            if _code(exc) in _TAKEN:
                return objstore.Written.EXISTED
            raise _wrap(exc, outcomes.SharedOperation.PUT, key) from exc
        except _TRANSPORT as exc:
            raise _wrap(exc, outcomes.SharedOperation.PUT, key) from exc
        return objstore.Written.CREATED

    async def put_file(self, key: str, path: Path) -> objstore.Written:
        try:
            size = (await asyncio.to_thread(path.stat)).st_size
        except OSError as exc:
            raise errors.SharedStoreError(
                f"reading {path.name} for upload: {exc}", operation=outcomes.SharedOperation.PUT
            ) from exc
        if size <= objstore.PART_BYTES:
            return await self.put_bytes(key, await asyncio.to_thread(path.read_bytes))
        s3 = await self._s3()
        try:
            upload = await s3.create_multipart_upload(Bucket=self._bucket, Key=key)
        except (botocore.exceptions.ClientError, *_TRANSPORT) as exc:
            raise _wrap(exc, outcomes.SharedOperation.PUT, key) from exc
        upload_id = upload["UploadId"]
        try:
            parts = await self._parts(s3, key, upload_id, path)
            await s3.complete_multipart_upload(
                Bucket=self._bucket,
                Key=key,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
                IfNoneMatch="*",
            )
        except botocore.exceptions.ClientError as exc:
            await self._abort(s3, key, upload_id)
            if _code(exc) in _TAKEN:
                return objstore.Written.EXISTED
            raise _wrap(exc, outcomes.SharedOperation.PUT, key) from exc
        except (*_TRANSPORT, errors.SharedStoreError) as exc:
            await self._abort(s3, key, upload_id)
            if isinstance(exc, errors.SharedStoreError):
                raise
            raise _wrap(exc, outcomes.SharedOperation.PUT, key) from exc
        except BaseException:
            abort = tasks.watch(
                asyncio.get_running_loop().create_task(self._abort(s3, key, upload_id), name="shared-abort-upload"),
                effect="an unfinished upload's parts stay in the bucket until its lifecycle rule removes them",
            )
            await asyncio.shield(abort)  # the abort goes on if this upload is cancelled
            raise
        return objstore.Written.CREATED

    async def _parts(self, s3: S3Client, key: str, upload_id: str, path: Path) -> list[CompletedPartTypeDef]:
        parts: list[CompletedPartTypeDef] = []
        try:
            fh = path.open("rb")
        except OSError as exc:
            raise errors.SharedStoreError(
                f"reading {path.name} for upload: {exc}", operation=outcomes.SharedOperation.PUT
            ) from exc
        with fh:
            number = 1
            while chunk := await asyncio.to_thread(fh.read, objstore.PART_BYTES):
                done = await s3.upload_part(
                    Bucket=self._bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=chunk
                )
                parts.append({"ETag": done["ETag"], "PartNumber": number})
                number += 1
        return parts

    async def _abort(self, s3: S3Client, key: str, upload_id: str) -> None:
        with contextlib.suppress(botocore.exceptions.ClientError, *_TRANSPORT):
            await s3.abort_multipart_upload(Bucket=self._bucket, Key=key, UploadId=upload_id)

    async def stream(self, key: str) -> AsyncIterator[bytes]:
        s3 = await self._s3()
        try:
            reply = await s3.get_object(Bucket=self._bucket, Key=key)
            async with reply["Body"] as body:
                while chunk := await body.read(1 << 20):
                    yield chunk
        except (botocore.exceptions.ClientError, *_TRANSPORT) as exc:
            raise _wrap(exc, outcomes.SharedOperation.GET, key) from exc

    async def get_bytes(self, key: str, *, limit: int) -> bytes:
        """The object, read with a range of ``limit + 1`` bytes: a larger object is refused, never read whole."""
        s3 = await self._s3()
        try:
            reply = await s3.get_object(Bucket=self._bucket, Key=key, Range=f"bytes=0-{limit}")
            async with reply["Body"] as body:
                chunks: list[bytes] = []
                left = limit + 1
                while left > 0 and (chunk := await body.read(left)):  # a read may return less than asked
                    chunks.append(chunk)
                    left -= len(chunk)
                data = b"".join(chunks)
        except botocore.exceptions.ClientError as exc:
            if _code(exc) in _EMPTY_RANGE:
                return b""  # a range of an empty object
            raise _wrap(exc, outcomes.SharedOperation.GET, key) from exc
        except _TRANSPORT as exc:
            raise _wrap(exc, outcomes.SharedOperation.GET, key) from exc
        return objstore.bounded(key, data, limit)

    async def head(self, key: str) -> objstore.ObjectInfo | None:
        s3 = await self._s3()
        try:
            reply = await s3.head_object(Bucket=self._bucket, Key=key)
        except botocore.exceptions.ClientError as exc:
            if _code(exc) in _ABSENT:
                return None
            raise _wrap(exc, outcomes.SharedOperation.GET, key) from exc
        except _TRANSPORT as exc:
            raise _wrap(exc, outcomes.SharedOperation.GET, key) from exc
        return objstore.ObjectInfo(key, reply["ContentLength"], _stamp(reply["LastModified"]))

    async def list_objects(self, prefix: str) -> list[objstore.ObjectInfo]:
        s3 = await self._s3()
        found: list[objstore.ObjectInfo] = []
        try:
            pages = s3.get_paginator("list_objects_v2").paginate(Bucket=self._bucket, Prefix=prefix)
            async for page in pages:
                for item in page.get("Contents", []):
                    found.append(objstore.ObjectInfo(item["Key"], item["Size"], _stamp(item["LastModified"])))
        except (botocore.exceptions.ClientError, *_TRANSPORT) as exc:
            raise _wrap(exc, outcomes.SharedOperation.LIST, prefix) from exc
        return found

    async def delete(self, keys: list[str]) -> None:
        s3 = await self._s3()
        for start in range(0, len(keys), 1000):
            batch = keys[start : start + 1000]
            try:
                reply = await s3.delete_objects(
                    Bucket=self._bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}
                )
            except (botocore.exceptions.ClientError, *_TRANSPORT) as exc:
                raise _wrap(exc, outcomes.SharedOperation.DELETE, batch[0]) from exc
            failed = [e for e in reply.get("Errors", []) if e.get("Code") not in _ABSENT]
            if failed:
                first = failed[0]
                raise errors.SharedStoreError(
                    f"deleting {len(failed)} object(s) failed, first {first.get('Key')}: "
                    f"{first.get('Code')} {first.get('Message')}",
                    operation=outcomes.SharedOperation.DELETE,
                )


def _code(exc: botocore.exceptions.ClientError) -> str:
    err = exc.response.get("Error", {})
    return str(err.get("Code") or exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))


def _wrap(exc: BaseException, operation: outcomes.SharedOperation, key: str) -> errors.SharedStoreError:
    if isinstance(exc, botocore.exceptions.ClientError):
        code = _code(exc)
        hint = ""
        if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            hint = ": check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and the bucket policy"
        elif code in ("NoSuchBucket",):
            hint = ": create the bucket, or fix the bucket in --shared-store"
        return errors.SharedStoreError(
            f"S3 {operation} {key}: {code}{hint}", operation=operation, missing=code in _ABSENT
        )
    return errors.SharedStoreError(f"S3 {operation} {key}: {type(exc).__name__}: {exc}", operation=operation)


def _stamp(value: datetime.datetime) -> float:
    return value.timestamp()
