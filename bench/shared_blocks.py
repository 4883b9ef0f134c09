"""Shared store, blocks against whole files: bytes moved per turn for agents sharing a system prompt on two nodes.

    python -m bench.shared_blocks [--quick]

Three agent conversations share a system prompt (about 2,000 tokens with
``--quick``, 6,000 in the full run) and take turns of about 60 words, one
slot each, on a llama-server running the random-weight model whose KV is
128 KiB per token (``tests.support.widekv``). After every turn the slot is saved
(llama-server's own save) and that one file goes, side by side, through two
pairs of nodes of the sidecar's shared-store code (in this process, each
node with its own slot dir, and for blocks its own block store) sharing one
real S3 server (SeaweedFS, ``tests/support/s3bed.py``):

* **whole files**: node A commits and uploads the file whole; node B
  fetches it whole (the sidecar without ``--store-dir``);
* **blocks**: node A commits it into its block store and uploads the blocks
  the bucket lacks; node B fetches the blocks its block store lacks
  (``--store-dir``).

Figures per way: bytes uploaded and downloaded (``shared_store_bytes_total``
of each node), over the KV that was new (tokens no earlier save held, the
shared prompt counted once, at 128 KiB each). Goal: blocks move at most half
the bytes whole files move, up and down. MET or MISSED each, exit status 1
on a miss.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import sys
from pathlib import Path

from bench import rig, section
from bench.beds import llamabed, s3bed, sharednodes, widekv
from sidecar.core import location
from sidecar.shared import service
from sidecar.snapshots import store

AGENTS = 3
WHOLE, BLOCKS = "whole files", "blocks"
RATIO_GOAL = 0.5
"""Blocks move at most this share of the bytes whole files move."""


@dataclasses.dataclass(slots=True)
class Way:
    name: str
    uploaded: float = 0.0
    downloaded: float = 0.0
    per_turn: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    """(uploaded, downloaded) bytes of each save."""


@dataclasses.dataclass(frozen=True, slots=True)
class Result:
    ways: dict[str, Way]
    new_kv: int
    saves: int
    file_bytes: int
    """Bytes of every saved file, summed."""


class _Node:
    """One node of a way: its slot dir, its block store (or none), its shared store client and metrics."""

    def __init__(self, root: Path, where: location.Location, *, blocks: bool) -> None:
        store_dir = root.with_name(root.name + "-store") if blocks else None
        snaps, shared, samples = sharednodes.node(root, where, store_dir=store_dir)
        self.snaps: store.SnapshotStore = snaps
        self.shared: service.SharedStore = shared
        self.samples = samples

    def moved(self, direction: str) -> float:
        return float(self.samples("shared_store_bytes_total", direction=direction))


async def _through(way: Way, a: _Node, b: _Node, saved: Path, *, slot: int, tokens: int) -> None:
    """Commit ``saved`` on node A, upload it, fetch it on node B; add the bytes each moved to ``way``."""
    temp = a.snaps.writer.temp_name(slot)
    shutil.copyfile(saved, a.snaps.staging / temp)
    record = await asyncio.to_thread(
        a.snaps.writer.commit, temp, slot=slot, tokens=tokens, written=saved.stat().st_size, task=None,
        fingerprint=sharednodes.FP,
    )  # fmt: skip
    up, down = a.moved("up"), b.moved("down")
    if not await a.shared.uploader.publish(record):
        raise rig.BenchError(f"{way.name}: node A did not publish {record.file}")
    ns = b.shared.namespace(sharednodes.IDENTITY)
    b.shared.catalog.forget(ns)
    found = [r for r in await b.shared.catalog.records(ns) if r.snapshot.checksum == record.checksum]
    if not found or await b.shared.fetch(found[0], slot=slot) is None:
        raise rig.BenchError(f"{way.name}: node B could not fetch {record.file}")
    moved = (a.moved("up") - up, b.moved("down") - down)
    way.uploaded += moved[0]
    way.downloaded += moved[1]
    way.per_turn.append(moved)


async def _run(server: llamabed.LlamaServer, s3: s3bed.S3Server, work: Path, *, system_tokens: int, turns: int,
               say: rig.Say) -> Result:  # fmt: skip
    s3.create_bucket("bench-blocks")
    env = {**os.environ, **s3.env()}
    pairs = {}
    for name in (WHOLE, BLOCKS):
        tag = "blocks" if name == BLOCKS else "whole"
        where = location.parse(f"s3://bench-blocks/{tag}", env)
        pairs[name] = (_Node(work / f"{tag}-a", where, blocks=name == BLOCKS),
                       _Node(work / f"{tag}-b", where, blocks=name == BLOCKS))  # fmt: skip
    ways = {name: Way(name) for name in pairs}
    system = llamabed.make_prompt(server.url, system_tokens, seed=880)
    shared = len(llamabed.tokenize(server.url, system))
    messages = [[{"role": "system", "content": system}] for _ in range(AGENTS)]
    words = [llamabed.make_prompt(server.url, 80 * (turns + 1), seed=900 + n).split() for n in range(AGENTS)]
    held = [0] * AGENTS
    new_kv = files = saves = 0
    try:
        for t in range(turns):
            for n in range(AGENTS):
                messages[n].append({"role": "user", "content": " ".join(words[n][60 * t : 60 * (t + 1)]) or "Go on."})
                body = {"messages": messages[n], "max_tokens": 12, "temperature": 0, "id_slot": n}
                status, answer = await asyncio.to_thread(
                    llamabed.http_json, "POST", server.url + "/v1/chat/completions", body, timeout=900
                )
                if status != 200:
                    raise rig.BenchError(f"an agent's turn answered HTTP {status}: {str(answer)[:200]}")
                messages[n].append({"role": "assistant", "content": answer["choices"][0]["message"]["content"] or "ok"})
                name = f"agent{n}-turn{t}.bin"
                status, done = await asyncio.to_thread(
                    llamabed.http_json, "POST", f"{server.url}/slots/{n}?action=save", {"filename": name}, timeout=900
                )
                if status != 200:
                    raise rig.BenchError(f"llama-server's save answered HTTP {status}: {str(done)[:200]}")
                tokens = int(done["n_saved"])
                new = tokens - held[n] - (shared if held[n] == 0 and n > 0 else 0)
                held[n] = tokens
                new_kv += max(0, new) * widekv.KV_BYTES_PER_TOKEN
                saved = Path(str(server.slot_dir)) / name
                files += saved.stat().st_size
                saves += 1
                for way_name, (a, b) in pairs.items():
                    await _through(ways[way_name], a, b, saved, slot=n, tokens=tokens)
                saved.unlink()
            say(f"  turn {t + 1} of {turns} of each agent saved, uploaded and fetched both ways")
    finally:
        for a, b in pairs.values():
            await a.shared.close()
            await b.shared.close()
    return Result(ways, new_kv, saves, files)


def table(result: Result) -> str:
    rows = [
        (w.name, w.uploaded / 2**20, w.uploaded / result.new_kv, w.downloaded / 2**20, w.downloaded / result.new_kv)
        for w in result.ways.values()
    ]
    head = (
        f"8B-class KV (128 KiB per token), {AGENTS} agents sharing a system prompt, {result.saves} saves "
        f"({result.file_bytes / 2**20:.0f} MiB of slot files, {result.new_kv / 2**20:.0f} MiB of new KV), "
        "each uploaded by node A and fetched by node B through SeaweedFS\n\n"
    )
    return head + rig.table(["way", "uploaded MiB", "up ÷ new KV", "downloaded MiB", "down ÷ new KV"], rows)


def verdicts(result: Result) -> list[str]:
    blocks, whole = result.ways[BLOCKS], result.ways[WHOLE]
    up, down = blocks.uploaded / whole.uploaded, blocks.downloaded / whole.downloaded
    checks = [
        (up <= RATIO_GOAL, f"blocks upload at most {RATIO_GOAL}x the bytes of whole files", f"{up:.3f}x"),
        (down <= RATIO_GOAL, f"blocks download at most {RATIO_GOAL}x the bytes of whole files", f"{down:.3f}x"),
    ]
    return [("MET  " if met else "MISSED ") + f"{goal}: {figure}" for met, goal, figure in checks]


def measure(bed: rig.Rig, *, quick: bool, say: rig.Say) -> tuple[Result, str]:
    system_tokens, turns = (2000, 4) if quick else (6000, 6)
    model = widekv.model(tokenizer_from=bed.model)
    slot_dir = bed.slot_dir("shared-blocks-slots")
    ctx = system_tokens + 120 * (turns + 2)
    server = bed.server(slot_dir=slot_dir, n_slots=AGENTS, ctx_size=ctx, model=model, swa_full=False)
    work = bed.slot_dir("shared-blocks-nodes")
    s3 = s3bed.S3Server(bed.slot_dir("shared-blocks-s3"))
    with s3:
        result = asyncio.run(_run(server, s3, work, system_tokens=system_tokens, turns=turns, say=say))
    server.kill()
    return result, table(result) + "\n\n" + "\n".join(verdicts(result))


def main(argv: list[str] | None = None) -> int:
    return section.main(
        argv,
        name="shared_blocks",
        doc=__doc__,
        title="Shared store: blocks against whole files",
        quick_help="a 2,000-token system prompt, 4 turns (else 6,000, 6)",
        measure=measure,
        missed=lambda result, quick: any(line.startswith("MISSED") for line in verdicts(result)),
    )


if __name__ == "__main__":
    sys.exit(main())
