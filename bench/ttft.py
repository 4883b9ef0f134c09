"""Time to the first token of a conversation's next turn after a kill -9.

For each size the same conversation is measured twice, on the same
llama-server (one slot, `--swa-full`):

* **restored**: a sidecar with its default settings runs beside the server;
  the conversation's prompt is sent, the sidecar snapshots the idle slot,
  the server is killed (SIGKILL) and started again, and once the sidecar
  reports the restore (`llama_sidecar_restored_tokens_total` grows) the
  next turn (prompt + a few words, `n_predict` 1) is timed. This is repeated
  `reps` times (the server is killed again right after the turn,
  long before the sidecar would save the grown slot, so each repetition
  restores the same snapshot) and the median is kept: one ~0.1 s request is
  easily disturbed by other work on a 2-core machine;
* **cold**: the sidecar is stopped, the slot dir emptied, the server killed
  and started again, and the same next turn is timed: a full re-prefill
  (also repeated, with a kill -9 before each, and the median kept).

While the cold server holds the conversation, the slot is saved and
restored directly a few times to measure snapshot size and the server's
save/restore cost (used by :mod:`bench.scaling`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import time
from pathlib import Path
from typing import Any

from bench import rig
from bench.beds import llamabed, sidecarbed


@dataclasses.dataclass(frozen=True, slots=True)
class SlotIO:
    """Direct save/restore of one slot, as the server and the client timed them."""

    tokens: int
    bytes: int
    save_ms: list[float]
    save_wall_ms: list[float]
    restore_ms: list[float]
    restore_wall_ms: list[float]
    sha256_ms: list[float]


@dataclasses.dataclass(frozen=True, slots=True)
class Point:
    tokens: int
    """Prompt tokens of the conversation before its next turn."""
    cold_runs: list[float]
    """Wall time of each cold repetition; `cold_s` is their median."""
    cold_prompt_ms: float
    cold_cache_n: int
    restored_runs: list[float]
    """Wall time of each restored repetition; `restored_s` is their median."""
    restored_prompt_ms: float
    cache_n: int
    """Tokens the next turn reused from the restored KV (server `timings.cache_n`), the least of the repetitions."""
    load_s: float
    """Restarted server: start to healthy (median)."""
    restore_wait_s: float
    """Restarted server healthy to the sidecar reporting the restore, bench-side (median)."""
    snapshot_tokens: int
    pressure: tuple[float | None, float | None]
    """CPU pressure (PSI avg10, %) after the restored and after the cold measurement."""
    io: SlotIO
    restore_waits: list[float] = dataclasses.field(default_factory=list)
    """Each restored repetition's wait from the server healthy to the sidecar reporting the restore."""

    @property
    def cold_s(self) -> float:
        return rig.median(self.cold_runs)

    @property
    def restored_s(self) -> float:
        return rig.median(self.restored_runs)

    @property
    def speedup(self) -> float:
        return self.cold_s / self.restored_s if self.restored_s > 0 else float("nan")

    @property
    def from_healthy_s(self) -> float:
        """What a user waits with the sidecar: healthy to restored, then the turn (median)."""
        return rig.median([w + r for w, r in zip(self.restore_waits, self.restored_runs, strict=True)])

    @property
    def speedup_from_healthy(self) -> float:
        """Cold turn over the wait for the restore plus the restored turn: both start at "healthy"."""
        return self.cold_s / self.from_healthy_s if self.from_healthy_s > 0 else float("nan")


def _restored_past(side: sidecarbed.SidecarProcess, before: float) -> bool:
    count: float = side.metric("llama_sidecar_restored_tokens_total", slot="0")
    return count > before


def timed(url: str, prompt: str) -> tuple[float, dict[str, Any]]:
    started = time.perf_counter()
    result = llamabed.complete(url, prompt, n_predict=1, id_slot=0)
    timings: dict[str, Any] = result["timings"]
    return time.perf_counter() - started, timings


def ctx_for(sizes: list[int]) -> int:
    need = int(max(sizes) * 1.05) + 512
    return -(-need // 1024) * 1024


def run(bed: rig.Rig, sizes: list[int], *, io_reps: int, reps: int, say: rig.Say) -> list[Point]:
    slot_dir = bed.slot_dir("ttft")
    server = bed.server(slot_dir=slot_dir, n_slots=1, ctx_size=ctx_for(sizes))
    points = []
    for n in sizes:
        points.append(_one(bed, server, slot_dir, n, io_reps=io_reps, reps=reps))
        p = points[-1]
        say(
            f"  {n:>6} tokens: cold {p.cold_s:.2f} s, restored {p.restored_s:.3f} s ({p.speedup:.0f}x), "
            f"from healthy {p.from_healthy_s:.3f} s ({p.speedup_from_healthy:.1f}x), cache_n {p.cache_n}"
        )
    server.kill()
    return points


def _one(bed: rig.Rig, server: llamabed.LlamaServer, slot_dir: Path, n: int, *, io_reps: int, reps: int) -> Point:
    url = server.url
    llamabed.slot_action(url, 0, "erase")  # the previous size's conversation must not be saved
    rig.clear_dir(slot_dir)
    prompt = llamabed.make_prompt(url, n, seed=n)
    side = bed.sidecar(server, slot_dir)
    first = llamabed.complete(url, prompt, n_predict=1, id_slot=0)
    n_prompt = int(first["timings"]["prompt_n"]) + int(first["timings"]["cache_n"])
    side.wait_for(lambda: rig.snapshot_of(side, 0, int(n_prompt * 0.95)), timeout=120, what="snapshot")
    snap = rig.snapshot_of(side, 0, int(n_prompt * 0.95))
    assert snap is not None
    runs, warms, loads, waits = [], [], [], []
    for _ in range(reps):
        before = side.metric("llama_sidecar_restored_tokens_total", slot="0")
        loads.append(server.restart(graceful=False, timeout=300))
        healthy = time.perf_counter()
        side.wait_for(functools.partial(_restored_past, side, before), timeout=120, what="restore after kill -9")
        waits.append(time.perf_counter() - healthy)
        restored_s, warm = timed(url, prompt + rig.NEXT_TURN)
        runs.append(restored_s)
        warms.append(warm)
    side.kill()
    restored_pressure = rig.cpu_pressure()

    rig.clear_dir(slot_dir)
    cold_runs, colds = [], []
    for _ in range(reps):
        server.restart(graceful=False, timeout=300)
        cold_s, cold = timed(url, prompt + rig.NEXT_TURN)
        cold_runs.append(cold_s)
        colds.append(cold)
    cold_pressure = rig.cpu_pressure()
    io = slot_io(url, slot_dir, reps=io_reps)
    return Point(
        tokens=n_prompt,
        cold_runs=cold_runs,
        cold_prompt_ms=rig.median([float(c["prompt_ms"]) for c in colds]),
        cold_cache_n=max(int(c["cache_n"]) for c in colds),
        restored_runs=runs,
        restored_prompt_ms=rig.median([float(w["prompt_ms"]) for w in warms]),
        cache_n=min(int(w["cache_n"]) for w in warms),
        load_s=rig.median(loads),
        restore_wait_s=rig.median(waits),
        snapshot_tokens=int(snap["tokens"]),
        pressure=(restored_pressure, cold_pressure),
        io=io,
        restore_waits=waits,
    )


def slot_io(url: str, slot_dir: Path, *, reps: int) -> SlotIO:
    """Save and restore slot 0 `reps` times under one name; hash the file each time."""
    name = "bench-io.bin"
    path = slot_dir / name
    saves, save_walls, restores, restore_walls, hashes = [], [], [], [], []
    tokens = size = 0
    for _ in range(reps):
        started = time.perf_counter()
        saved = llamabed.slot_action(url, 0, "save", name)
        save_walls.append((time.perf_counter() - started) * 1000)
        saves.append(float(saved["timings"]["save_ms"]))
        tokens, size = int(saved["n_saved"]), int(saved["n_written"])
        started = time.perf_counter()
        with path.open("rb") as fh:
            hashlib.file_digest(fh, "sha256")
        hashes.append((time.perf_counter() - started) * 1000)
        started = time.perf_counter()
        restored = llamabed.slot_action(url, 0, "restore", name)
        restore_walls.append((time.perf_counter() - started) * 1000)
        restores.append(float(restored["timings"]["restore_ms"]))
    path.unlink(missing_ok=True)
    return SlotIO(tokens, size, saves, save_walls, restores, restore_walls, hashes)


def table(points: list[Point]) -> str:
    rows = [
        [
            p.tokens,
            p.cold_s,
            p.restored_s,
            f"{p.speedup:.1f}",
            p.from_healthy_s,
            f"{p.speedup_from_healthy:.1f}",
            p.cache_n,
            p.cold_prompt_ms,
            p.restored_prompt_ms,
            "/".join(f"{r:.2f}" for r in p.cold_runs),
            "/".join(f"{r:.3f}" for r in p.restored_runs),
            p.load_s,
            p.restore_wait_s,
            "/".join("-" if v is None else f"{v:.0f}" for v in p.pressure),
        ]
        for p in points
    ]
    headers = [
        "tokens",
        "cold s",
        "restored s",
        "speed-up x",
        "healthy->answered s",
        "from healthy x",
        "cache_n",
        "cold prompt_ms",
        "restored prompt_ms",
        "cold runs s",
        "restored runs s",
        "load s",
        "healthy->restored s",
        "CPU pressure % restored/cold",
    ]
    return rig.table(headers, rows)
