"""Does snapshotting one slot stall a client streaming on another?

llama-server runs slot saves on its main loop, so every slot waits while
one is written. Here a client streams tokens on slot 0 (`"stream": true`)
while slot 1's conversation grows by a few words every `period` seconds.
Four conditions with the same slot-1 traffic alternate, one window each per
round, so drift in the machine's load hits all of them:

* no sidecar (the baseline: no saves);
* the bench itself saving slot 1 2.5 s after each change (the server's own
  cost of a save, without the sidecar's process): each save to a new file,
  the one before deleted after it, as the sidecar keeps its snapshots (a
  save over the same file reuses its blocks and costs the server less);
* the sidecar with `--save-hold-seconds 0`: it saves slot 1 once idle 2 s
  after each change, while slot 0 generates: the same saves as the bench's,
  plus the sidecar's own work (polls, a read of `/slots` before each save;
  the commit, checksum and fdatasync, waits until the stream ends);
* the sidecar with its defaults: it holds those saves while slot 0 is
  processing and takes them once the stream ends (counted after the window).

For every save: whether it landed during slot 0's generation (tokens were
streamed before and after it).

Measured: the gaps between consecutive streamed tokens (the wait for the
first token, which includes prompt processing, is not a gap). A round whose
baseline window (no sidecar, no saves) has a median gap more than
`DISTURBED` times the median of all baseline windows' medians was slowed by
other work on the machine and is left out of the pooled figures; the
sidecar's windows never decide that, so a sidecar that slows every gap is
reported, not dropped. The per-window table shows every window.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from bench import client, rig
from bench.beds import llamabed, sidecarbed, wait

NONE, DIRECT, SIDECAR, HELD = "no sidecar", "bench saves slot 1", "sidecar, hold off", "sidecar (defaults: hold)"
SIDECARS = {SIDECAR: {"--save-hold-seconds": "0"}, HELD: {}}
"""The sidecar's conditions and their options."""
HELD_SAVE_WAIT = 60.0
"""After a window with the hold, how long the bench waits for the held save to land."""
DIRECT_SAVE_AFTER = 2.5
"""The bench's own save follows a change after about as long as the sidecar's would (idle 2 s + poll)."""
DISTURBED = 1.5
DIRECT_FILE = "bench-direct"
"""The bench's own saves are `bench-direct-<n>.bin` in the slot dir."""


@dataclasses.dataclass(slots=True)
class Window:
    round: int
    gaps_ms: list[float]
    saves: int
    save_gaps_ms: list[float]
    """For each save, the longest inter-token gap overlapping its call to the server."""
    changes: int
    pressure: float | None
    """CPU pressure (PSI avg10, %) at the window's end."""
    during_generation: int = 0
    """Saves that landed while slot 0 streamed (tokens before and after the save)."""
    after_stream: int = 0
    """Held saves that landed once the stream had ended (sidecar with the hold)."""
    kept: bool = True
    disturbed: bool = False

    @property
    def p50(self) -> float:
        return rig.percentile(self.gaps_ms, 50)


@dataclasses.dataclass(slots=True)
class Condition:
    name: str
    windows: list[Window] = dataclasses.field(default_factory=list)
    save_server_ms: list[float] = dataclasses.field(default_factory=list)

    def _kept(self) -> list[Window]:
        return [w for w in self.windows if w.kept]

    @property
    def gaps_ms(self) -> list[float]:
        return [g for w in self._kept() for g in w.gaps_ms]

    @property
    def save_gaps_ms(self) -> list[float]:
        return [g for w in self._kept() for g in w.save_gaps_ms]

    @property
    def saves(self) -> int:
        return sum(w.saves for w in self._kept())

    @property
    def changes(self) -> int:
        return sum(w.changes for w in self._kept())

    @property
    def during_generation(self) -> int:
        return sum(w.during_generation for w in self._kept())

    @property
    def after_stream(self) -> int:
        return sum(w.after_stream for w in self._kept())


def window(
    server: llamabed.LlamaServer,
    convo: list[str],
    *,
    seconds: float,
    period: float,
    save_after: float | None,
    save_ms: list[float],
    slot_dir: Path,
) -> tuple[float, float, list[float], list[tuple[float, float]], int]:
    """One measuring window; returns (start, end, token times, direct saves, changes), times in unix time.

    `save_after`: the bench itself saves slot 1 this long after each change (no sidecar), each
    time to a new file in `slot_dir`, and deletes the file before.
    """
    times: list[float] = []
    saves: list[tuple[float, float]] = []
    changes = 0
    thread = threading.Thread(target=client.stream, args=(server.port, seconds, times), name="stream", daemon=True)
    start = time.time()
    thread.start()
    wait.wait_until(lambda: len(times) >= 2, timeout=120, what="first streamed tokens")
    began = time.monotonic()
    while time.monotonic() - began < seconds - period:
        cycle = time.monotonic()
        convo.append(f" {len(convo)} more")
        llamabed.complete(server.url, "".join(convo), n_predict=1, id_slot=1)
        changes += 1
        if save_after is not None:
            time.sleep(max(0.0, cycle + save_after - time.monotonic()))
            began_save = time.time()
            saved = llamabed.slot_action(server.url, 1, "save", f"{DIRECT_FILE}-{changes}.bin")
            saves.append((began_save, time.time()))
            save_ms.append(float(saved["timings"]["save_ms"]))
            (slot_dir / f"{DIRECT_FILE}-{changes - 1}.bin").unlink(missing_ok=True)
        time.sleep(max(0.0, cycle + period - time.monotonic()))
    thread.join(timeout=seconds + 60)
    end = time.time()
    rig.wait_idle(server.url)
    return start, end, times, saves, changes


def run(bed: rig.Rig, *, base_tokens: int, seconds: float, rounds: int, period: float, say: rig.Say) -> list[Condition]:
    """Four conditions: no saves, the bench saving slot 1 itself, the sidecar without and with the hold."""
    slot_dir = bed.slot_dir("stall")
    server = bed.server(slot_dir=slot_dir, n_slots=2, ctx_size=8192)
    convo = [llamabed.make_prompt(server.url, base_tokens, seed=11)]
    llamabed.complete(server.url, convo[0], n_predict=1, id_slot=1)
    conds = [Condition(NONE), Condition(DIRECT), Condition(SIDECAR), Condition(HELD)]
    for r in range(rounds):
        for cond in conds:
            side = bed.sidecar(server, slot_dir, **SIDECARS[cond.name]) if cond.name in SIDECARS else None
            if side is not None:
                side.wait_for(
                    functools.partial(_slot1_saved, side, slot_dir, base_tokens // 2),
                    timeout=120,
                    what="slot 1 saved",
                )
                client.settle(side)
            start, end, times, saves, changes = window(
                server,
                convo,
                seconds=seconds,
                period=period,
                save_after=DIRECT_SAVE_AFTER if cond.name == DIRECT else None,
                save_ms=cond.save_server_ms,
                slot_dir=slot_dir,
            )
            after = 0
            if side is not None:
                client.settle(side)  # the commits that waited for the stream's end are logged
                saves = sidecar_saves(side, cond, start, end)
                if cond.name == HELD and changes:
                    after = _held_saves(side, end)
                side.kill()
            for direct in slot_dir.glob(f"{DIRECT_FILE}-*.bin"):
                direct.unlink()
            gaps = [(b - a) * 1000 for a, b in itertools.pairwise(times)]
            w = Window(r + 1, gaps, len(saves), holding(saves, times), changes, rig.cpu_pressure())
            w.during_generation = sum(1 for began, ended in saves if during(began, ended, times))
            w.after_stream = after
            cond.windows.append(w)
            say(
                f"  round {r + 1}/{rounds} {cond.name}: {len(times)} tokens, p50 gap {w.p50:.1f} ms, "
                f"p99 {rig.percentile(gaps, 99):.1f} ms, {w.saves} saves ({w.during_generation} during generation"
                + (f", {after} after the stream)" if cond.name == HELD else ")")
            )
    server.kill()
    drop_disturbed(conds)
    return conds


def sidecar_saves(
    side: sidecarbed.SidecarProcess, cond: Condition, start: float, end: float
) -> list[tuple[float, float]]:
    """(start, end) of the save calls of the sidecar's committed saves that began inside the window."""
    spans = []
    for entry in side.log_events("snapshot_committed"):
        began = float(entry["saved_at"])
        if entry.get("slot") == 1 and start <= began <= end:
            cond.save_server_ms.append(float(entry.get("server_ms") or 0.0))
            spans.append((began, began + float(entry["save_seconds"])))
    return spans


def _slot1_saved(side: sidecarbed.SidecarProcess, slot_dir: Path, min_tokens: int) -> bool:
    """Slot 1 saved by this sidecar, or by the one before (a snapshot in the slot dir)."""
    mine = rig.snapshot_of(side, 1, min_tokens) is not None
    return mine or any(name.startswith("slot1-") for name in sidecarbed.manifests(slot_dir))


def _held_saves(side: sidecarbed.SidecarProcess, end: float) -> int:
    """Wait for the save of slot 1 the hold put off until the stream ended; 1 once it landed."""

    def landed() -> bool:
        return any(e.get("slot") == 1 and rig.log_time(e) > end for e in side.log_events("snapshot_committed"))

    try:
        wait.wait_until(landed, timeout=HELD_SAVE_WAIT, what="the held save of slot 1", every=0.2)
    except wait.TimedOut:
        return 0
    return 1


def during(began: float, ended: float, times: list[float]) -> bool:
    """Whether a save from `began` to `ended` landed while the stream was producing tokens."""
    return bool(times) and times[0] < ended and began < times[-1]


def holding(saves: list[tuple[float, float]], times: list[float]) -> list[float]:
    """For each save, the longest inter-token gap overlapping it, in ms."""
    out = []
    for began, ended in saves:
        overlapping = [(b - a) * 1000 for a, b in itertools.pairwise(times) if a < ended and b > began]
        if overlapping:
            out.append(max(overlapping))
    return out


def drop_disturbed(conds: list[Condition]) -> None:
    """Leave out the rounds in which the machine, not a save, slowed the stream.

    Judged on the baseline alone (no sidecar, no saves): a round is disturbed
    when its baseline window's median gap is more than `DISTURBED` times the
    median of all baseline windows' medians. The sidecar's own windows never
    count, so a sidecar that slows every gap is measured, not excused.
    """
    base = pick(conds, NONE).windows
    ref = rig.median([w.p50 for w in base])
    bad = {w.round for w in base if not w.p50 <= DISTURBED * ref}
    windows = [w for c in conds for w in c.windows]
    for w in windows:
        w.disturbed = w.round in bad
    if len(bad) == len({w.round for w in windows}):
        return  # every round was disturbed: keep them all rather than nothing (the verdict is withheld)
    for w in windows:
        w.kept = not w.disturbed


def windows_table(conds: list[Condition]) -> str:
    rows = []
    for w, name in sorted(((w, c.name) for c in conds for w in c.windows), key=lambda x: x[0].round):
        rows.append(
            [
                w.round,
                name,
                len(w.gaps_ms),
                w.p50,
                rig.percentile(w.gaps_ms, 99),
                max(w.gaps_ms, default=float("nan")),
                w.saves,
                w.during_generation,
                "-" if w.pressure is None else f"{w.pressure:.0f}",
                "NO (disturbed)" if not w.kept else "yes (disturbed)" if w.disturbed else "yes",
            ]
        )
    headers = [
        "round",
        "condition",
        "gaps",
        "p50 ms",
        "p99 ms",
        "max ms",
        "saves",
        "during generation",
        "CPU pressure %",
        "kept",
    ]
    return rig.table(headers, rows, digits=1)


def table(conds: list[Condition]) -> str:
    rows = []
    for c in conds:
        g = c.gaps_ms
        rows.append(
            [
                c.name,
                len(g),
                rig.percentile(g, 50),
                rig.percentile(g, 90),
                rig.percentile(g, 99),
                max(g) if g else float("nan"),
                c.changes,
                c.saves,
                c.during_generation,
                c.after_stream if c.name == HELD else "-",
                rig.median(c.save_server_ms),
                rig.median(c.save_gaps_ms),
                rig.median(c.save_gaps_ms) - rig.percentile(g, 50),
            ]
        )
    headers = [
        "kept rounds",
        "gaps",
        "p50 ms",
        "p90 ms",
        "p99 ms",
        "max ms",
        "slot-1 changes",
        "saves",
        "during generation",
        "after the stream",
        "save_ms (server)",
        "longest gap over a save ms",
        "  minus p50 ms",
    ]
    return rig.table(headers, rows, digits=1)


def pick(conds: list[Condition], name: str) -> Condition:
    return next(c for c in conds if c.name == name)


def disturbed(conds: list[Condition]) -> bool:
    """Whether the pooled figures include a disturbed round (when no round was clean)."""
    return any(w.kept and w.disturbed for c in conds for w in c.windows)


def p99_ratio(conds: list[Condition], over: str = NONE, side: str = SIDECAR) -> float:
    """p99 gap of condition `side` over p99 gap of condition `over` (default: hold off over no saves)."""
    return rig.percentile(pick(conds, side).gaps_ms, 99) / rig.percentile(pick(conds, over).gaps_ms, 99)


def p50_ratio(conds: list[Condition]) -> float:
    """Median gap with the sidecar over median gap with no saves at all."""
    return rig.percentile(pick(conds, SIDECAR).gaps_ms, 50) / rig.percentile(pick(conds, NONE).gaps_ms, 50)


def round_p99_ratios(conds: list[Condition], over: str = NONE, side: str = SIDECAR) -> list[float]:
    """:func:`p99_ratio` of each kept round; with a single kept round, of each half of it (in time order)."""
    ours, theirs = pick(conds, side), pick(conds, over)
    pairs: list[tuple[Sequence[float], Sequence[float]]] = [
        (w.gaps_ms, v.gaps_ms) for w in ours.windows for v in theirs.windows if w.round == v.round and w.kept and v.kept
    ]
    if len(pairs) == 1:
        ((mine, base),) = pairs
        pairs = list(zip(rig.halves(mine), rig.halves(base), strict=True))
    return [rig.percentile(a, 99) / rig.percentile(b, 99) for a, b in pairs]
