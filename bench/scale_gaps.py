"""The stream on one slot while the other slot's conversation is saved, at an 8B-class KV: the sidecar's policy
against no saves at all. Part of the scale section (:mod:`bench.scale`); report only, no goal.

One llama-server (the 8B-class-KV model, 2 slots, the slot dir on tmpfs),
slot 1 holding an agent's conversation of the scale section's size. In each
window a client streams a long completion on slot 0 (directly, ``stream``)
while slot 1's conversation grows by a few words every ``period`` seconds
(:func:`bench.stall.window`), the same turns two ways, alternating:

* **no sidecar**: no saves at all;
* **sidecar's policy**: the sidecar at its defaults with ``--store-dir``
  (saves held while another slot generates, up to ``--save-hold-seconds``,
  then made anyway; each save stalls every slot while the server writes the
  whole slot).

Figures per way: the p50 and p99 of the gaps between streamed tokens, the
saves of slot 1 the sidecar made during the window, how many of them landed
while slot 0 streamed, and how many it made once the stream had ended (the
held ones). The ratio reported is the policy's p99 gap over no saves'.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import shutil
from pathlib import Path

from bench import client, rig, stall
from bench.beds import llamabed, sidecarbed, widekv

NO_SAVES, POLICY = stall.NONE, "sidecar's policy"
"""No sidecar: no saves at all; the sidecar at its defaults with ``--store-dir``."""
SAVED_WAIT = 120.0
"""After a window, how long the bench waits for the sidecar to have saved slot 1's last change."""


@dataclasses.dataclass(frozen=True, slots=True)
class Gaps:
    conditions: list[stall.Condition]
    slot_tokens: int
    """Tokens slot 1 held at the end."""

    def p99_ratio(self) -> float:
        return stall.p99_ratio(self.conditions, over=NO_SAVES, side=POLICY)


def run(
    bed: rig.Rig, *, base_tokens: int, seconds: float, period: float, rounds: int, staging: Path, say: rig.Say
) -> Gaps:
    model = widekv.model(tokenizer_from=bed.model)
    slot_dir = staging / f"llama-kv-bench-{os.getpid()}-gaps"
    store_dir = bed.slot_dir("scale-gaps-store")
    shutil.rmtree(slot_dir, ignore_errors=True)
    slot_dir.mkdir(parents=True)
    try:
        server = bed.server(slot_dir=slot_dir, n_slots=2, ctx_size=2 * 16384, model=model, swa_full=False)
        convo = [llamabed.make_prompt(server.url, base_tokens, seed=882)]
        llamabed.complete(server.url, convo[0], n_predict=1, id_slot=1)
        conds = [stall.Condition(NO_SAVES), stall.Condition(POLICY)]
        for r in range(rounds):
            for cond in conds:
                _window(bed, server, cond, convo, r, slot_dir, store_dir, seconds=seconds, period=period, say=say)
        tokens = len(llamabed.tokenize(server.url, "".join(convo)))
        server.kill()
        stall.drop_disturbed(conds)
        return Gaps(conds, tokens)
    finally:
        shutil.rmtree(slot_dir, ignore_errors=True)


def _window(
    bed: rig.Rig,
    server: llamabed.LlamaServer,
    cond: stall.Condition,
    convo: list[str],
    r: int,
    slot_dir: Path,
    store_dir: Path,
    *,
    seconds: float,
    period: float,
    say: rig.Say,
) -> None:
    """One window of ``cond``: the stream on slot 0 while slot 1's conversation grows."""
    side = bed.sidecar(server, slot_dir, **{"--store-dir": str(store_dir)}) if cond.name == POLICY else None
    if side is not None:
        _all_saved(side)  # what changed before this window is saved first, as between turns
        client.settle(side)
    start, end, times, _, changes = stall.window(
        server, convo, seconds=seconds, period=period, save_after=None, save_ms=[], slot_dir=slot_dir
    )
    saves: list[tuple[float, float]] = []
    after = 0
    if side is not None:
        _all_saved(side)
        client.settle(side)
        saves = stall.sidecar_saves(side, cond, start, end)
        after = sum(1 for e in side.log_events("snapshot_committed") if e.get("slot") == 1 and rig.log_time(e) > end)
        side.kill()
    gaps = [(b - a) * 1000 for a, b in itertools.pairwise(times)]
    w = stall.Window(r + 1, gaps, len(saves), stall.holding(saves, times), changes, rig.cpu_pressure())
    w.during_generation = sum(1 for began, ended in saves if stall.during(began, ended, times))
    w.after_stream = after
    cond.windows.append(w)
    say(
        f"  gaps round {r + 1} {cond.name}: {len(times)} tokens, p50 gap {w.p50:.1f} ms, "
        f"p99 {rig.percentile(gaps, 99):.1f} ms, {w.saves} saves in the window ({w.during_generation} during "
        f"the stream), {after} after it, {changes} changes of slot 1"
    )


def _all_saved(side: sidecarbed.SidecarProcess) -> None:
    side.wait_for(
        lambda: (
            side.metric("llama_sidecar_slot_unsaved_since_timestamp_seconds", slot="1") == 0
            and side.metric("llama_sidecar_snapshots_total", slot="1", result="ok") > 0
        ),
        timeout=SAVED_WAIT,
        what="slot 1's changes saved",
    )


def table(gaps: Gaps) -> str:
    rows = [
        (
            c.name,
            len(c.gaps_ms),
            rig.percentile(c.gaps_ms, 50),
            rig.percentile(c.gaps_ms, 99),
            c.saves,
            c.during_generation,
            c.after_stream,
            c.changes,
        )
        for c in gaps.conditions
    ]
    head = (
        f"A stream on slot 0 while slot 1's conversation ({gaps.slot_tokens} tokens at the end, 128 KiB of KV per "
        "token) grows, the sidecar's policy against no saves\n\n"
    )
    return head + rig.table(
        ["way", "gaps", "p50 ms", "p99 ms", "saves in windows", "during the stream", "after it", "changes"], rows
    )


def report(gaps: Gaps) -> str:
    policy = stall.pick(gaps.conditions, POLICY)
    return (
        f"REPORT p99 token gap, the sidecar's policy saving the other slot ÷ no saves: {gaps.p99_ratio():.2f}x "
        f"({policy.saves} saves of slot 1 in the windows, {policy.during_generation} during the stream, "
        f"{policy.after_stream} after it; no saves: 0)"
    )
