"""Scale: agent conversations at an 8B-class KV through the proxy, slot files whole against the block store.

Three agent conversations share a system prompt (about 2,000 tokens, 1,500
words, with ``--quick``; about 10,000 in the full run) and take turns of
about 60 words on a llama-server with 2 slots, at its defaults (RAM prompt
cache on), through the sidecar's proxy, on the random-weight model whose KV
is 128 KiB per token (``tests.support.widekv``). Then, once the sidecar has saved
what the slots hold (a crash between turns, as hosts see them), llama-server
is ``kill -9``ed and each conversation sends its next turn. The same turns
run two ways on fresh servers, one after the other:

* **whole files**: ``--slot-dir`` on disk, no ``--store-dir``: every save
  is a whole slot file on disk (the sidecar before the block store);
* **block store**: ``--slot-dir`` on tmpfs, ``--store-dir`` on disk: the
  server's saves land in RAM and only the blocks the store lacks reach the
  disk.

Figures per way: bytes written to disk by llama-server and the sidecar
(``write_bytes`` of ``/proc/PID/io``; a write to tmpfs counts none) over
the distinct KV the conversations hold (the shared prompt counted once:
every byte of it was new KV once); bytes the snapshots take on disk over
that distinct KV; what a user waits for a restored slot after the ``kill
-9``: the mean of ``restart_to_restore_seconds`` over the restart round's
restores, from the restarted server answering /health ok (when a restore
could start) to the slot restored, the same figure both ways (with the block
store it holds any rebuild not done ahead, while the server loaded), beside
the restore calls alone (``restore_duration_seconds``) and the restores
that took a file rebuilt ahead; and each conversation's turn after the
``kill -9``: tokens reused over its previous prompt.

Then, on the block-store way with the sidecar stopped, its largest snapshot
restored into the same server (:mod:`bench.scale_restore`): rebuilt from its
blocks into the slot dir by the sidecar's own code plus the server's restore
call, against the server's restore call of the same file staged whole in the
slot dir, alternated, medians.

Then the stream on one slot while the other slot's conversation is saved
(:mod:`bench.scale_gaps`): the p99 gap between streamed tokens with the
sidecar's policy (its defaults, ``--store-dir``) over no saves at all, the
same turns, and the saves each made; reported, no goal.

Goals (issue 41), on the block-store way: written at most 1.5x the new KV,
stored at most 1.2x the distinct KV, a restore (the rebuild plus the
server's restore) at most 1.2x the server's own restore of the same whole
file from staging, and every turn after the ``kill -9`` at least 99% cached.
MET or MISSED each, exit status 1 on a miss. Reported beside, no goal: the
wait for a restored slot against the whole-file way's (its slot dir on disk).

Run alone with ``python -m bench.scale [--quick]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from bench import REPO_ROOT, rig, scale_gaps, scale_restore
from bench.beds import llamabed, net, sidecarbed, widekv
from sidecar.core import mounts

SLOTS = 2
CONVERSATIONS = 3
WHOLE, BLOCKS = "whole files", "block store"
WRITTEN_GOAL, STORED_GOAL, CACHED_GOAL = 1.5, 1.2, 0.99
STAGING = Path("/dev/shm")
"""Where the block store's slot dirs go (``--staging``): a tmpfs."""


@dataclasses.dataclass(frozen=True, slots=True)
class Way:
    name: str
    written: int
    """Bytes llama-server (both processes) and the sidecar wrote to disk."""
    stored: int
    """Bytes of the snapshots on disk at the end."""
    distinct_tokens: int
    wait_seconds: float
    """What a user waits for a restored slot after the kill -9: the mean, over the restart round's restores, of
    the restarted server answering /health ok to the slot restored (restart_to_restore_seconds); NaN if none."""
    restore_seconds: float
    """Mean of the sidecar's restore calls (restore_duration_seconds: the server's restore only), NaN if none."""
    ahead: int
    """Restores that took a file rebuilt ahead, while the server loaded (restore_ahead_total{outcome="used"})."""
    after_kill: list[float]
    """Per conversation, tokens reused by the turn after the kill -9 over its previous prompt."""
    turns: int
    restores: scale_restore.Restores | None = None
    """The block-store way: its largest snapshot restored rebuilt from blocks against staged whole."""

    @property
    def distinct_bytes(self) -> int:
        return self.distinct_tokens * widekv.KV_BYTES_PER_TOKEN


class _Agent:
    def __init__(self, n: int, system: str, url: str) -> None:
        self.n = n
        self.messages = [{"role": "system", "content": system}]
        self.words = llamabed.make_prompt(url, 80 * 12, seed=900 + n).split()
        self.prompt = 0
        self.total = 0

    def turn(self, url: str) -> int:
        """Send the next turn; the tokens its answer reused."""
        k = len(self.messages) // 2
        self.messages.append({"role": "user", "content": " ".join(self.words[60 * k : 60 * (k + 1)]) or "Go on."})
        body = {"messages": self.messages, "max_tokens": 12, "temperature": 0}
        status, answer = llamabed.http_json("POST", url + "/v1/chat/completions", body, timeout=900)
        if status != 200:
            raise rig.BenchError(f"an agent's turn answered HTTP {status}: {str(answer)[:200]}")
        self.messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"] or "ok"})
        self.prompt = int(answer["usage"]["prompt_tokens"])
        self.total = self.prompt + int(answer["usage"]["completion_tokens"])
        return int(answer["timings"]["cache_n"])


def _written(pid: int) -> int:
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    raise rig.BenchError(f"/proc/{pid}/io has no write_bytes")


def _bytes_under(*roots: Path) -> int:
    return sum(p.stat().st_size for root in roots if root.exists() for p in root.rglob("*") if p.is_file())


def _way(bed: rig.Rig, name: str, *, system_tokens: int, turns: int, reps: int, staging: Path, say: rig.Say) -> Way:
    model = widekv.model(tokenizer_from=bed.model)
    tag = "blocks" if name == BLOCKS else "whole"
    store_dir = bed.slot_dir(f"scale-store-{tag}")
    slot_dir = staging / f"llama-kv-bench-{os.getpid()}-{tag}" if name == BLOCKS else store_dir
    if name == BLOCKS:
        shutil.rmtree(slot_dir, ignore_errors=True)
        slot_dir.mkdir(parents=True)
    try:
        server = bed.server(slot_dir=slot_dir, n_slots=SLOTS, ctx_size=2 * 16384, model=model, swa_full=False)
        port = net.free_port()
        options = {"--proxy-listen": f"127.0.0.1:{port}"}
        if name == BLOCKS:
            options["--store-dir"] = str(store_dir)
        side = bed.sidecar(server, slot_dir, **options)
        side.wait_for(lambda: side.get("/readyz")[0] == 200, timeout=120, what="the sidecar ready")
        url = f"http://127.0.0.1:{port}"
        system = llamabed.make_prompt(server.url, system_tokens, seed=880)
        shared = len(llamabed.tokenize(server.url, system))
        agents = [_Agent(n, system, server.url) for n in range(CONVERSATIONS)]
        side_written = _written(side.proc.pid) if side.proc is not None else 0
        for t in range(turns):
            for agent in agents:
                agent.turn(url)
            say(f"  {name}: turn {t + 1} of {turns} sent by each agent")
        side.wait_for(
            lambda: side.metric("llama_sidecar_library_conversations") >= CONVERSATIONS,
            timeout=300,
            what="every conversation in the library",
        )
        side.wait_for(  # the slots' last turns saved once idle, as a host's crash finds them between turns
            lambda: all(side.metric("llama_sidecar_slot_unsaved_since_timestamp_seconds", slot=str(s)) == 0 for s in
                        range(SLOTS)),
            timeout=120,
            what="every slot's changes saved",
        )  # fmt: skip
        written = _written(server.pid)
        server.kill()
        server.start()
        server.wait_healthy(timeout=300)
        prompts = [a.prompt for a in agents]
        after = [a.turn(url) / p for a, p in zip(agents, prompts, strict=True)]
        say(f"  {name}: after the kill -9, reused " + ", ".join(f"{x:.1%}" for x in after))
        written += _written(server.pid)
        assert side.proc is not None
        written += _written(side.proc.pid) - side_written
        wait = _mean(side, "llama_sidecar_restart_to_restore_seconds")
        restore = _mean(side, "llama_sidecar_restore_duration_seconds")
        ahead = int(side.metric("llama_sidecar_restore_ahead_total", outcome="used"))
        stored = _bytes_under(store_dir)
        side.kill()
        restores = scale_restore.run(server.url, slot_dir, store_dir, reps=reps, say=say) if name == BLOCKS else None
        server.kill()
        distinct = shared + sum(a.total - shared for a in agents)
        return Way(name, written, stored, distinct, wait, restore, ahead, after, turns, restores)
    finally:
        if name == BLOCKS:
            shutil.rmtree(slot_dir, ignore_errors=True)


def _mean(side: sidecarbed.SidecarProcess, histogram: str) -> float:
    count = side.metric(histogram + "_count")
    return side.metric(histogram + "_sum") / count if count else float("nan")


def table(ways: list[Way]) -> str:
    rows = [
        (
            w.name,
            w.distinct_bytes / 2**20,
            w.written / 2**20,
            w.written / w.distinct_bytes,
            w.stored / 2**20,
            w.stored / w.distinct_bytes,
            w.wait_seconds,
            w.restore_seconds,
            w.ahead,
            min(w.after_kill),
        )
        for w in ways
    ]
    head = (
        f"8B-class KV (128 KiB per token), {CONVERSATIONS} agents sharing a system prompt on {SLOTS} slots through "
        f"the proxy, llama-server's defaults, {ways[0].turns} turns each, then kill -9 and one more\n\n"
    )
    return head + rig.table(
        [
            "way",
            "distinct KV MiB",
            "written MiB",
            "written/KV",
            "stored MiB",
            "stored/KV",
            "wait s",
            "restore call s",
            "rebuilt ahead",
            "min after kill",
        ],
        rows,
    )


def verdicts(ways: list[Way]) -> list[str]:
    """MET or MISSED per goal, then the wait for a restored slot against the whole-file way's, reported."""
    by = {w.name: w for w in ways}
    blocks, whole = by[BLOCKS], by[WHOLE]
    if blocks.restores is None:
        raise rig.BenchError("the block-store way measured no restore from its store")
    wait = blocks.wait_seconds / whole.wait_seconds
    checks = [
        (blocks.written / blocks.distinct_bytes <= WRITTEN_GOAL, f"written ÷ new KV at most {WRITTEN_GOAL}x",
         f"{blocks.written / blocks.distinct_bytes:.2f}x (whole files {whole.written / whole.distinct_bytes:.2f}x)"),
        (blocks.stored / blocks.distinct_bytes <= STORED_GOAL, f"stored ÷ distinct KV at most {STORED_GOAL}x",
         f"{blocks.stored / blocks.distinct_bytes:.2f}x (whole files {whole.stored / whole.distinct_bytes:.2f}x)"),
        scale_restore.judged(blocks.restores),
        (min(blocks.after_kill) >= CACHED_GOAL, f"every turn after the kill -9 at least {CACHED_GOAL:.0%} cached",
         ", ".join(f"{x:.1%}" for x in blocks.after_kill)),
    ]  # fmt: skip
    return [("MET  " if met else "MISSED ") + f"{goal}: {figure}" for met, goal, figure in checks] + [
        f"REPORT the wait for a restored slot after the kill -9 (server healthy -> slot restored), the block store "
        f"÷ whole files with the slot dir on disk: {wait:.2f}x ({blocks.wait_seconds:.3f} s against "
        f"{whole.wait_seconds:.3f} s; the restore calls alone {blocks.restore_seconds:.3f} s against "
        f"{whole.restore_seconds:.3f} s; restores that took a file rebuilt ahead: {blocks.ahead})"
    ]


def measure(bed: rig.Rig, *, quick: bool, say: rig.Say, staging: Path = STAGING) -> tuple[list[Way], str]:
    """``staging``: the tmpfs the block store's slot dirs go under."""
    system_tokens, turns, reps = (2000, 4, 7) if quick else (10000, 8, 11)
    ways = [
        _way(bed, name, system_tokens=system_tokens, turns=turns, reps=reps, staging=staging, say=say)
        for name in (WHOLE, BLOCKS)
    ]
    seconds, rounds = (40.0, 1) if quick else (60.0, 2)
    gaps = scale_gaps.run(
        bed, base_tokens=system_tokens, seconds=seconds, period=4.0, rounds=rounds, staging=staging, say=say
    )
    notes = [scale_gaps.report(gaps)]
    if mounts.tmpfs_of_small_pages(staging):
        notes.append(
            f"NOTE {staging} is a tmpfs of small pages (mounted without huge=): llama-server reads a restored file "
            "from it about 2.5x slower than from a disk's page cache, which the wait against whole files on disk shows "
            "(the restore goal reads from it both ways); "
            "--staging a tmpfs mounted with huge=within_size for the block store's best"
        )
    restores = [scale_restore.table(w.restores) for w in ways if w.restores is not None]
    return ways, "\n\n".join([table(ways), *restores, scale_gaps.table(gaps), "\n".join([*verdicts(ways), *notes])])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 2,000-token system prompt, 4 turns (else 10,000, 8)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "out", help="JSON and logs go here")
    parser.add_argument("--threads", type=int, default=2, help="llama-server -t (default 2)")
    parser.add_argument(
        "--staging",
        type=Path,
        default=STAGING,
        help="the tmpfs the block store's slot dirs go under (default /dev/shm; a tmpfs mounted with "
        "huge=within_size lets llama-server read a restored file as fast as from a disk's page cache)",
    )
    ns = parser.parse_args(argv)
    bed = rig.Rig(log_dir=ns.out / f"logs-scale-{time.strftime('%Y%m%d-%H%M%S')}", threads=ns.threads)
    try:
        before = rig.busy()
        ways, body = measure(
            bed, quick=ns.quick, say=lambda text: print(text, file=sys.stderr, flush=True), staging=ns.staging
        )
        print(f"## Scale\n({before} at start, {rig.busy()} at end)\n")
        print(body)
    finally:
        bed.close()
    raw: list[dict[str, Any]] = [dataclasses.asdict(w) for w in ways]
    (ns.out / "scale.json").write_text(json.dumps(raw, indent=2))
    return 1 if any(line.startswith("MISSED") for line in verdicts(ways)) else 0


if __name__ == "__main__":
    sys.exit(main())
