"""Time to first token on node B: cold prefill, fetch from the shared store + restore, local restore.

    python -m bench.shared_ttft [--sizes 1024,4096] [--threads 2]

For each conversation size, with the test beds' real llama-server, real
model and real S3 server (SeaweedFS on loopback):

1. node A prefills the conversation, saves the slot, commits it to its slot
   dir and uploads it (``SharedStore`` as the sidecar runs it): *upload*;
2. a fresh llama-server (node B, its own slot dir) answers the next turn
   cold: *cold*;
3. a fresh node B looks the conversation up in the shared store by its block
   hashes, fetches it into its slot dir (download, size and checksum checks,
   commit), restores it and answers the next turn: *shared*;
4. a fresh node B restores the same file from its own slot dir and answers:
   *local*.

TTFT is the wall time of a one-token completion of the next turn (and, for
*shared* and *local*, the fetch and restore before it). Ratios are to the
cold prefill; they are what to compare across machines.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from bench import REPO_ROOT, beds, rig
from sidecar.core import events, location, metrics, protocols
from sidecar.shared import service
from sidecar.snapshots import manifest, slotfile, store

BUCKET = "bench-ttft"
IDENTITY = events.Identity("bench", "/models/bench.gguf", 1, 16384, 1, 1)


def _node(root: Path, where: location.Location) -> tuple[store.SnapshotStore, service.SharedStore]:
    root.mkdir(parents=True, exist_ok=True)
    snaps = store.SnapshotStore(root, clock=protocols.SystemClock())
    return snaps, service.SharedStore(where, snapshots=snaps, stats=metrics.Metrics(CollectorRegistry(), version="b"))


def _ttft(url: str, prompt: str) -> float:
    started = time.perf_counter()
    beds.llamabed.complete(url, prompt, n_predict=1)
    return time.perf_counter() - started


def measure_size(bed: rig.Rig, where: location.Location, tokens: int, say: rig.Say) -> dict[str, Any]:
    dir_a = bed.slot_dir(f"a-{tokens}")
    snaps_a, shared_a = _node(dir_a, where)
    server = bed.server(slot_dir=dir_a, n_slots=1, ctx_size=16384)
    prompt = beds.llamabed.make_prompt(server.url, tokens, seed=tokens)
    say(f"[shared_ttft] {tokens} tokens: node A prefills and saves")
    beds.llamabed.complete(server.url, prompt, n_predict=1)
    temp = snaps_a.writer.temp_name(0)
    saved = beds.llamabed.slot_action(server.url, 0, "save", temp)
    record = snaps_a.writer.commit(
        temp,
        slot=0,
        tokens=int(saved["n_saved"]),
        written=int(saved["n_written"]),
        task=None,
        fingerprint=manifest.Fingerprint.of(IDENTITY, n_ctx=16384),
    )
    started = time.perf_counter()
    asyncio.run(_publish(shared_a, record))
    upload = time.perf_counter() - started
    next_turn = prompt + rig.NEXT_TURN

    dir_b = bed.slot_dir(f"b-{tokens}")
    _, shared_b = _node(dir_b, where)
    say(f"[shared_ttft] {tokens} tokens: node B cold")
    server = bed.server(slot_dir=dir_b, n_slots=1, ctx_size=16384)
    cold = _ttft(server.url, next_turn)

    say(f"[shared_ttft] {tokens} tokens: node B fetches and restores")
    server = bed.server(slot_dir=dir_b, n_slots=1, ctx_size=16384)
    # tokenized as the completion will be: with the BOS token (add_special), like the slot file's ids
    ids = beds.llamabed.call("POST", server.url + "/tokenize", {"content": next_turn, "add_special": True})["tokens"]
    chain = slotfile.prefix_hashes(slotfile.pack_ids(ids))
    started = time.perf_counter()
    fetched = asyncio.run(_fetch(shared_b, chain))
    fetch = time.perf_counter() - started
    beds.llamabed.slot_action(server.url, 0, "restore", fetched.file)
    restore = time.perf_counter() - started - fetch
    shared = fetch + restore + _ttft(server.url, next_turn)

    say(f"[shared_ttft] {tokens} tokens: node B restores its local copy")
    server = bed.server(slot_dir=dir_b, n_slots=1, ctx_size=16384)
    started = time.perf_counter()
    beds.llamabed.slot_action(server.url, 0, "restore", fetched.file)
    local = time.perf_counter() - started + _ttft(server.url, next_turn)
    server.kill()
    return {
        "tokens": tokens,
        "bytes": record.bytes,
        "upload": upload,
        "cold": cold,
        "fetch": fetch,
        "restore": restore,
        "shared": shared,
        "local": local,
    }


async def _publish(shared: service.SharedStore, record: manifest.Manifest) -> None:
    try:
        assert await shared.uploader.publish(record), "the snapshot was not uploaded"
    finally:
        await shared.close()


async def _fetch(shared: service.SharedStore, chain: tuple[str, ...]) -> manifest.Manifest:
    try:
        match = await shared.lookup(IDENTITY, chain, max_tokens=16384)
        assert match is not None, "the lookup found nothing"
        fetched = await shared.fetch(match.record, slot=0)
        assert fetched is not None, "the fetch failed"
        return fetched
    finally:
        await shared.close()


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| tokens | snapshot MB | upload s | cold TTFT s | fetch s | restore s | shared TTFT s | local TTFT s | "
        "cold / shared | cold / local |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['tokens']:,} | {r['bytes'] / 1e6:.1f} | {r['upload']:.2f} | {r['cold']:.2f} | {r['fetch']:.2f} | "
            f"{r['restore']:.3f} | {r['shared']:.2f} | {r['local']:.2f} | {r['cold'] / r['shared']:.1f}x | "
            f"{r['cold'] / r['local']:.1f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.shared_ttft", description=__doc__)
    parser.add_argument("--sizes", default="1024,4096", help="conversation sizes in tokens")
    parser.add_argument("--threads", type=int, default=2, help="llama-server -t")
    ns = parser.parse_args(argv)
    say: rig.Say = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-s3-") as tmp:
        s3 = beds.s3bed.S3Server(Path(tmp))
        bed = rig.Rig(log_dir=REPO_ROOT / "bench" / "out" / "shared-ttft", threads=ns.threads)
        try:
            s3.start()
            s3.create_bucket(BUCKET)
            where = location.parse(f"s3://{BUCKET}/ttft", s3.env())
            for size in (int(s) for s in ns.sizes.split(",")):
                rows.append(measure_size(bed, where, size, say))
        finally:
            bed.close()
            s3.stop()
    print(f"S3 server on loopback (SeaweedFS); load avg {rig.loadavg()[0]:.2f} at end; {rig.busy()}\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
