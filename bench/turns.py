"""The block store at chat-size turns: written and stored over the KV, and what stays in RAM staging.

Three conversations share a system prompt of about 1,500 words (2,000 tokens) and take turns of about
90 tokens (a user message and a 12-token answer) through the proxy, on a llama-server with 2 slots at
its defaults, on the random-weight model whose KV is 128 KiB per token (``tests.support.widekv``); the
slot dir is a tmpfs (``--staging``, default ``/dev/shm``), ``--store-dir`` on disk. Then, once the
sidecar has saved what the slots hold, llama-server is ``kill -9``ed and each conversation sends one
more turn. Figures:

* **written**: bytes llama-server (both processes) and the sidecar wrote to disk (``write_bytes`` of
  ``/proc/PID/io``; a write to the tmpfs counts none) over the new KV, the distinct KV of the
  conversations (the shared prompt counted once: every byte of it was new KV once);
* **stored**: bytes under the store dir at the end over that distinct KV;
* **staged when idle**: bytes left in the slot dir (RAM) once every slot's changes are saved and no
  request runs, after waiting up to ``IDLE_SECONDS`` for it to empty.

Goals: written at most 1.5x, stored at most 1.2x, nothing staged when idle, every turn after the
``kill -9`` at least 99% cached. MET or MISSED each, exit status 1 on a miss.

Run alone with ``python -m bench.turns [--turns N] [--staging DIR]``.
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

from bench import REPO_ROOT, rig
from bench.beds import llamabed, net, widekv

SLOTS = 2
CONVERSATIONS = 3
SYSTEM_TOKENS = 2000
"""About 1,500 words."""
USER_WORDS = 45
"""Words of each user message: with the template's tokens and a 12-token answer, a turn of about 90 tokens."""
ANSWER_TOKENS = 12
WRITTEN_GOAL, STORED_GOAL, CACHED_GOAL = 1.5, 1.2, 0.99
IDLE_SECONDS = 60.0
"""How long the slot dir is given to empty once everything is saved (a spare rebuild waits 30 s for reuse)."""
STAGING = Path("/dev/shm")
TURNS = 4
"""Turns per conversation before the kill -9: with the one after it, about 14 saves."""


@dataclasses.dataclass(frozen=True, slots=True)
class Run:
    written: int
    stored: int
    distinct_tokens: int
    turn_tokens: float
    """Mean tokens a turn added to a conversation (its message, the template's, the answer)."""
    saves: int
    staged_idle: int
    """Bytes in the slot dir once idle (after up to ``IDLE_SECONDS``)."""
    staged_files: list[str]
    emptied_seconds: float
    """Seconds from every save done to the slot dir empty (``IDLE_SECONDS`` if it never was)."""
    after_kill: list[float]

    @property
    def distinct_bytes(self) -> int:
        return self.distinct_tokens * widekv.KV_BYTES_PER_TOKEN


class _Conversation:
    def __init__(self, n: int, system: str, url: str) -> None:
        self.messages = [{"role": "system", "content": system}]
        self.words = llamabed.make_prompt(url, 80 * 12, seed=700 + n).split()
        self.prompts: list[int] = []
        self.total = 0

    def turn(self, url: str) -> int:
        """Send the next turn; the tokens its answer reused."""
        k = len(self.messages) // 2
        text = " ".join(self.words[USER_WORDS * k : USER_WORDS * (k + 1)]) or "Go on."
        self.messages.append({"role": "user", "content": text})
        body = {"messages": self.messages, "max_tokens": ANSWER_TOKENS, "temperature": 0}
        status, answer = llamabed.http_json("POST", url + "/v1/chat/completions", body, timeout=900)
        if status != 200:
            raise rig.BenchError(f"a turn answered HTTP {status}: {str(answer)[:200]}")
        self.messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"] or "ok"})
        self.prompts.append(int(answer["usage"]["prompt_tokens"]))
        self.total = self.prompts[-1] + int(answer["usage"]["completion_tokens"])
        return int(answer["timings"]["cache_n"])


def _written(pid: int) -> int:
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    raise rig.BenchError(f"/proc/{pid}/io has no write_bytes")


OWN_PREFIX = ".llama-kv-sidecar"
"""The sidecar's lock and the slot dir's weights record: a few bytes, not staged KV."""


def _files(folder: Path) -> dict[str, int]:
    """Regular files in ``folder`` (not links, not folders, not the sidecar's own records) and their sizes."""
    out: dict[str, int] = {}
    for entry in os.scandir(folder):
        if entry.is_file(follow_symlinks=False) and not entry.name.startswith(OWN_PREFIX):
            out[entry.name] = entry.stat(follow_symlinks=False).st_size
    return out


def _bytes_under(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def run(bed: rig.Rig, *, turns: int, staging: Path, say: rig.Say) -> Run:
    model = widekv.model(tokenizer_from=bed.model)
    store_dir = bed.slot_dir("turns-store")
    slot_dir = staging / f"llama-kv-bench-{os.getpid()}-turns"
    shutil.rmtree(slot_dir, ignore_errors=True)
    slot_dir.mkdir(parents=True)
    try:
        server = bed.server(slot_dir=slot_dir, n_slots=SLOTS, ctx_size=2 * 16384, model=model, swa_full=False)
        port = net.free_port()
        side = bed.sidecar(server, slot_dir, **{"--proxy-listen": f"127.0.0.1:{port}", "--store-dir": str(store_dir)})
        side.wait_for(lambda: side.get("/readyz")[0] == 200, timeout=120, what="the sidecar ready")
        assert side.proc is not None
        url = f"http://127.0.0.1:{port}"
        system = llamabed.make_prompt(server.url, SYSTEM_TOKENS, seed=880)
        shared = len(llamabed.tokenize(server.url, system))
        talks = [_Conversation(n, system, server.url) for n in range(CONVERSATIONS)]
        side_written = _written(side.proc.pid)
        for t in range(turns):
            for talk in talks:
                talk.turn(url)
            say(f"  turn {t + 1} of {turns} sent by each conversation")
        _saved(side)
        written = _written(server.pid)
        server.kill()
        server.start()
        server.wait_healthy(timeout=300)
        before = [c.prompts[-1] for c in talks]
        after = [c.turn(url) / p for c, p in zip(talks, before, strict=True)]
        say("  after the kill -9, reused " + ", ".join(f"{x:.1%}" for x in after))
        _saved(side)
        idle_from = time.monotonic()
        while _files(slot_dir) and time.monotonic() < idle_from + IDLE_SECONDS:
            time.sleep(0.5)
        left = _files(slot_dir)
        emptied = time.monotonic() - idle_from
        written += _written(server.pid) + _written(side.proc.pid) - side_written
        saves = int(side.metric("llama_sidecar_snapshots_total", slot="0", result="ok")) + int(
            side.metric("llama_sidecar_snapshots_total", slot="1", result="ok")
        )
        stored = _bytes_under(store_dir)
        side.kill()
        server.kill()
        grown = [(c.prompts[-1] - c.prompts[0]) / (len(c.prompts) - 1) for c in talks]
        distinct = shared + sum(c.total - shared for c in talks)
        return Run(
            written,
            stored,
            distinct,
            sum(grown) / len(grown),
            saves,
            sum(left.values()),
            [f"{name} ({size / 2**20:.0f} MiB)" for name, size in sorted(left.items())],
            emptied,
            after,
        )
    finally:
        shutil.rmtree(slot_dir, ignore_errors=True)


def _saved(side: Any) -> None:
    side.wait_for(
        lambda: side.metric("llama_sidecar_library_conversations") >= CONVERSATIONS
        and all(side.metric("llama_sidecar_slot_unsaved_since_timestamp_seconds", slot=str(s)) == 0
                for s in range(SLOTS)),
        timeout=300,
        what="every conversation in the library and every slot's changes saved",
    )  # fmt: skip


def verdicts(run: Run) -> list[str]:
    checks = [
        (run.written / run.distinct_bytes <= WRITTEN_GOAL, f"written ÷ new KV at most {WRITTEN_GOAL}x",
         f"{run.written / run.distinct_bytes:.2f}x"),
        (run.stored / run.distinct_bytes <= STORED_GOAL, f"stored ÷ distinct KV at most {STORED_GOAL}x",
         f"{run.stored / run.distinct_bytes:.2f}x"),
        (run.staged_idle == 0, "nothing staged in RAM when idle",
         f"{run.staged_idle / 2**30:.2f} GiB {IDLE_SECONDS:.0f} s after the last save"
         + (f": {', '.join(run.staged_files)}" if run.staged_files else f" (empty after {run.emptied_seconds:.1f} s)")),
        (min(run.after_kill) >= CACHED_GOAL, f"every turn after the kill -9 at least {CACHED_GOAL:.0%} cached",
         ", ".join(f"{x:.1%}" for x in run.after_kill)),
    ]  # fmt: skip
    return [("MET  " if met else "MISSED ") + f"{goal}: {figure}" for met, goal, figure in checks]


def table(run: Run, turns: int) -> str:
    head = (
        f"8B-class KV (128 KiB per token), {CONVERSATIONS} conversations sharing a {SYSTEM_TOKENS}-token system "
        f"prompt on {SLOTS} slots through the proxy, {turns} turns each of {run.turn_tokens:.0f} tokens, then "
        f"kill -9 and one more; {run.saves} saves\n\n"
    )
    row = (
        run.distinct_bytes / 2**20,
        run.written / 2**20,
        run.written / run.distinct_bytes,
        run.stored / 2**20,
        run.stored / run.distinct_bytes,
        run.staged_idle / 2**20,
    )
    headers = ["distinct KV MiB", "written MiB", "written/KV", "stored MiB", "stored/KV", "staged idle MiB"]
    return head + rig.table(headers, [row])


def measure(bed: rig.Rig, *, quick: bool, say: rig.Say, staging: Path = STAGING) -> tuple[Run, str]:
    """The section's run (``quick`` or not: the same 4 turns, a run takes a few minutes)."""
    del quick
    result = run(bed, turns=TURNS, staging=staging, say=say)
    return result, table(result, TURNS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.turns", description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=TURNS, help=f"turns per conversation before the kill -9 ({TURNS})")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "out", help="JSON and logs go here")
    parser.add_argument("--threads", type=int, default=2, help="llama-server -t (default 2)")
    parser.add_argument("--staging", type=Path, default=STAGING, help="the tmpfs the slot dir goes under")
    ns = parser.parse_args(argv)
    bed = rig.Rig(log_dir=ns.out / f"logs-turns-{time.strftime('%Y%m%d-%H%M%S')}", threads=ns.threads)
    try:
        before = rig.busy()
        result = run(bed, turns=ns.turns, staging=ns.staging, say=lambda t: print(t, file=sys.stderr, flush=True))
        print(f"## Turns\n({before} at start, {rig.busy()} at end)\n")
        print(table(result, ns.turns))
        print()
        print("\n".join(verdicts(result)))
    finally:
        bed.close()
    (ns.out / "turns.json").write_text(json.dumps(dataclasses.asdict(result), indent=2))
    return 1 if any(line.startswith("MISSED") for line in verdicts(result)) else 0


if __name__ == "__main__":
    sys.exit(main())
