"""Which S3 client for the shared store: obstore against aiobotocore, on a real S3 server.

    python -m bench.shared_store [--mib 200] [--reps 2]

Starts the test bed's S3 server (SeaweedFS, ``tests/support/s3bed.py``),
writes a random file of ``--mib`` MiB, and for each client, in a fresh
process of its own (so peak RSS is that client's alone):

* uploads the file streamed from disk (multipart, 8 MiB parts) and
  downloads it streamed to disk, best of ``--reps``, as MiB/s;
* peak RSS growth over the process after imports (a client that holds the
  whole object in memory grows by about the object's size);
* conditional create (``If-None-Match: *``): a second create of the same key
  must be refused, on a single PUT and on a multipart upload.

Prints one table and the ratios of the two clients.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import REPO_ROOT, beds

PART = 8 * 1024 * 1024
CLIENTS = ("obstore", "aiobotocore")


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def _obstore(env: dict[str, str], bucket: str, src: Path, dst: Path, reps: int) -> dict[str, Any]:
    import obstore  # noqa: PLC0415 - each worker process imports only the client it measures
    from obstore.store import S3Store  # noqa: PLC0415

    store = S3Store(
        bucket,
        endpoint=env["AWS_ENDPOINT_URL_S3"],
        access_key_id=env["AWS_ACCESS_KEY_ID"],
        secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region=env["AWS_REGION"],
        client_options={"allow_http": True},
    )
    base = _rss_mib()
    up, down = [], []
    for i in range(reps):
        started = time.perf_counter()
        await obstore.put_async(store, f"ob/{i}", src, chunk_size=PART, max_concurrency=4)
        up.append(time.perf_counter() - started)
        started = time.perf_counter()
        resp = await obstore.get_async(store, f"ob/{i}")
        with dst.open("wb") as fh:
            async for chunk in resp.stream(min_chunk_size=PART):
                fh.write(chunk)
        down.append(time.perf_counter() - started)
    streamed_rss = _rss_mib() - base

    async def refused(**kw: Any) -> bool:
        try:
            await obstore.put_async(store, "ob/cond", src, mode="create", **kw)
        except obstore.exceptions.AlreadyExistsError:
            return True
        return False

    small = b"x" * 1024
    await obstore.put_async(store, "ob/small", small, mode="create")
    try:
        await obstore.put_async(store, "ob/small", small, mode="create")
        single = False
    except obstore.exceptions.AlreadyExistsError:
        single = True
    # mode="create" makes obstore send one PUT: the whole file is read into memory first.
    await refused()
    multipart = await refused()
    return {
        "up": min(up),
        "down": min(down),
        "rss_stream": streamed_rss,
        "rss_create": _rss_mib() - base,
        "create_single": single,
        "create_multipart": "no (create mode is a single PUT of the whole object)" if multipart else "no",
    }


async def _aiobotocore(env: dict[str, str], bucket: str, src: Path, dst: Path, reps: int) -> dict[str, Any]:
    import aiobotocore.session  # noqa: PLC0415 - each worker process imports only the client it measures
    import botocore.exceptions  # noqa: PLC0415

    session = aiobotocore.session.get_session()
    async with session.create_client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL_S3"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_REGION"],
    ) as client:
        base = _rss_mib()

        async def multipart(key: str, **complete: Any) -> None:
            upload = await client.create_multipart_upload(Bucket=bucket, Key=key)
            parts: list[Any] = []
            with src.open("rb") as fh:
                number = 1
                while chunk := fh.read(PART):
                    done = await client.upload_part(
                        Bucket=bucket, Key=key, UploadId=upload["UploadId"], PartNumber=number, Body=chunk
                    )
                    parts.append({"ETag": done["ETag"], "PartNumber": number})
                    number += 1
            try:
                await client.complete_multipart_upload(
                    Bucket=bucket,
                    Key=key,
                    UploadId=upload["UploadId"],
                    MultipartUpload={"Parts": parts},
                    **complete,
                )
            except BaseException:
                await client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload["UploadId"])
                raise

        up, down = [], []
        for i in range(reps):
            started = time.perf_counter()
            await multipart(f"bc/{i}")
            up.append(time.perf_counter() - started)
            started = time.perf_counter()
            resp = await client.get_object(Bucket=bucket, Key=f"bc/{i}")
            with dst.open("wb") as fh:
                async with resp["Body"] as body:
                    while chunk := await body.read(1 << 20):
                        fh.write(chunk)
            down.append(time.perf_counter() - started)
        streamed_rss = _rss_mib() - base

        async def refused(call: Any) -> bool:
            try:
                await call()
            except botocore.exceptions.ClientError as err:
                return err.response["Error"]["Code"] in ("PreconditionFailed", "412")
            return False

        async def small() -> None:
            await client.put_object(Bucket=bucket, Key="bc/small", Body=b"x" * 1024, IfNoneMatch="*")

        await small()
        single = await refused(small)
        await multipart("bc/cond", IfNoneMatch="*")
        multi = await refused(lambda: multipart("bc/cond", IfNoneMatch="*"))
        return {
            "up": min(up),
            "down": min(down),
            "rss_stream": streamed_rss,
            "rss_create": _rss_mib() - base,
            "create_single": single,
            "create_multipart": "yes" if multi else "no",
        }


def worker(argv: list[str]) -> None:
    client, bucket, src, dst, reps = argv[0], argv[1], Path(argv[2]), Path(argv[3]), int(argv[4])
    env = dict(os.environ)
    fn = _obstore if client == "obstore" else _aiobotocore
    result = asyncio.run(fn(env, bucket, src, dst, reps))
    assert dst.stat().st_size == src.stat().st_size, "download size differs"
    print(json.dumps(result))


def measure(*, mib: int, reps: int, say: Any = print) -> tuple[dict[str, dict[str, Any]], str]:

    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-s3-") as tmp:
        work = Path(tmp)
        src, dst = work / "object.bin", work / "download.bin"
        with src.open("wb") as fh:
            for _ in range(mib):
                fh.write(os.urandom(1 << 20))
        server = beds.s3bed.S3Server(work / "s3")
        started = time.perf_counter()
        with server:
            say(f"S3 server answering after {time.perf_counter() - started:.1f} s")
            server.create_bucket("bench-shared")
            for client in CLIENTS:
                say(f"[shared_store] {client}: {reps} x {mib} MiB up and down")
                done = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "bench.shared_store",
                        "--worker",
                        client,
                        "bench-shared",
                        str(src),
                        str(dst),
                        str(reps),
                    ],
                    env={**os.environ, **server.env()},
                    cwd=REPO_ROOT,
                    capture_output=True,
                    text=True,
                    check=False,
                )
                if done.returncode != 0:
                    raise RuntimeError(f"{client} worker failed ({done.returncode}):\n{done.stderr[-3000:]}")
                results[client] = json.loads(done.stdout.strip().splitlines()[-1])
    return results, table(results, mib=mib, reps=reps)


def table(results: dict[str, dict[str, Any]], *, mib: int, reps: int) -> str:
    lines = [
        f"{mib} MiB object, SeaweedFS on loopback, best of {reps}; RSS growth over the process after imports",
        "",
        "| client | up MiB/s | down MiB/s | RSS growth streaming | RSS growth after create | "
        "If-None-Match single PUT | If-None-Match multipart |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {mib / r['up']:.0f} | {mib / r['down']:.0f} | {r['rss_stream']:.0f} MiB | "
            f"{r['rss_create']:.0f} MiB | {'yes' if r['create_single'] else 'no'} | {r['create_multipart']} |"
        )
    if len(results) == 2:
        a, b = (results[c] for c in CLIENTS)
        lines += [
            "",
            f"obstore / aiobotocore: upload {b['up'] / a['up']:.2f}x, download {b['down'] / a['down']:.2f}x "
            "(above 1: obstore faster)",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--worker"]:
        worker(args[1:])
        return 0
    parser = argparse.ArgumentParser(prog="python -m bench.shared_store", description=__doc__)
    parser.add_argument("--mib", type=int, default=200)
    parser.add_argument("--reps", type=int, default=2)
    ns = parser.parse_args(args)
    _, body = measure(mib=ns.mib, reps=ns.reps, say=lambda s: print(s, file=sys.stderr, flush=True))
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
