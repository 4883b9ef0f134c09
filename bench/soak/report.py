"""The soak's report: figures and invariants, each invariant MET or MISSED, the seed and the schedule.

:func:`verdicts` is pure: the invariants from the counters. :func:`render` is the text printed at the end;
``python -m bench.soak`` exits 1 when one invariant is MISSED.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from bench.soak import invariants, schedule

MIN_JUDGED = 5
"""Turns after a first turn a run must have judged: fewer, and its invariants held for nothing."""


@dataclasses.dataclass(frozen=True, slots=True)
class Figures:
    seed: int
    minutes: float
    events: tuple[schedule.Event, ...]
    faults_done: dict[str, int]
    faults_skipped: dict[str, int]
    turns: dict[str, int]
    """Turns by verdict (:class:`invariants.Verdict`)."""
    errors_allowed: int
    errors_cut: list[str]
    """Errors of answers under way when llama-server was killed: a stream already under way cannot be
    hidden; counted and shown apart, not an invariant here."""
    clients: int
    errors: list[str]
    """Client-visible errors no outage of the sidecar explains."""
    kv_checks: int
    kv_wrong: list[str]
    kv_worst: float
    reuse_beyond: int
    peaks: dict[str, float]
    breaches: list[str]
    orphans: int
    sigterm_status: list[int]
    back_seconds: list[float]
    verify_status: int
    verify_summary: str
    store: dict[str, int]
    budget: int
    notes: list[str]
    rss_growth: float | None
    """The sidecar's RSS at the end over its RSS as the steady stretch began (the last
    :data:`schedule.STEADY_SHARE` of the run, one process); None if no process lived through it."""
    history: list[dict[str, float | int | str]] = dataclasses.field(default_factory=list)
    """Every judged turn (conversation, started, ended, cached, prompt, verdict): the JSON report's, so that a
    run's verdicts can be judged again by a later classifier."""
    windows: list[dict[str, float | str | None]] = dataclasses.field(default_factory=list)
    """Every fault as done (fault, at, until), as the verdicts saw them."""

    def judged(self) -> int:
        """Turns after a conversation's first: the ones whose reuse says something."""
        return sum(n for verdict, n in self.turns.items() if verdict != invariants.Verdict.FIRST)

    def warm_share(self) -> float:
        return self.turns.get(invariants.Verdict.WARM, 0) / self.judged() if self.judged() else 0.0


def steady_minutes(f: Figures) -> float:
    """Minutes of the run's steady stretch: no fault ends the sidecar there."""
    return f.minutes * schedule.STEADY_SHARE


def verdicts(f: Figures) -> dict[str, bool]:
    """Each invariant: True when it held."""
    bounds = invariants.Bounds()
    rss: dict[str, bool] = {}
    if steady_minutes(f) >= bounds.rss_minutes:  # shorter: the growth is caches filling, not a leak
        name = f"RSS growth at most {bounds.rss_growth - 1:.0%} over the last {steady_minutes(f):g} minutes"
        rss[name] = f.rss_growth is not None and f.rss_growth <= bounds.rss_growth
    return {
        f"enough turns to judge (at least {MIN_JUDGED} after a first turn)": f.judged() >= MIN_JUDGED,
        "never a wrong KV": not f.kv_wrong and f.reuse_beyond == 0,
        "no conversation lost": f.turns.get(invariants.Verdict.LOST, 0) == 0,
        "no client-visible error outside the sidecar's own outages": not f.errors,
        "bounded resources": not f.breaches,
        "no orphan llama-server": f.orphans == 0,
        "SIGTERM exits 0": all(code == 0 for code in f.sigterm_status),
        "verify clean": f.verify_status == 0,
        "every referenced block is there": f.store.get("missing", 0) == 0 and f.store.get("unreadable", 0) == 0,
        **rss,
    }


def render(f: Figures) -> str:
    held = verdicts(f)
    lines = [
        f"# soak: seed {f.seed}, {f.minutes:g} minutes, {f.clients} clients",
        "",
        "## faults (done / skipped: not doable at that moment)",
        *(f"  {kind:<16} {f.faults_done.get(kind, 0):4d} / {f.faults_skipped.get(kind, 0)}" for kind in schedule.Fault),
        f"  total            {sum(f.faults_done.values()):4d} of {len(f.events)} scheduled",
        f"  sidecar back (fault to /readyz 200), s: {', '.join(f'{s:.1f}' for s in f.back_seconds) or '-'}",
        "",
        "## turns",
        *(f"  {verdict.value:<16} {f.turns.get(verdict, 0):5d}" for verdict in invariants.Verdict),
        f"  warm share       {f.warm_share():.3f} (warm over every turn but first turns)",
        f"  errors           {len(f.errors)} unexplained, {f.errors_allowed} on the sidecar's own outages, "
        f"{len(f.errors_cut)} of answers under way at a kill -9 of llama-server",
        *(f"    {e}" for e in f.errors[:10]),
        *(f"    cut: {e}" for e in f.errors_cut[:10]),
        "",
        "## wrong KV (checked against a cold reference server)",
        f"  checks {f.kv_checks}, worst move {f.kv_worst:.3f} of the first token's probability (bound "
        f"{invariants.WRONG_KV}), "
        f"wrong {len(f.kv_wrong)}, reuse beyond the conversation's history {f.reuse_beyond}",
        *(f"    {e}" for e in f.kv_wrong[:10]),
        "",
        "## resources (peaks)",
        *(f"  {name:<16} {value:,.0f}" for name, value in sorted(f.peaks.items())),
        f"  store budget     {f.budget:,}",
        f"  RSS growth       {'-' if f.rss_growth is None else f'{f.rss_growth:.3f}x'} over the last "
        f"{steady_minutes(f):g} minutes (one sidecar process; judged when at least "
        f"{invariants.Bounds().rss_minutes:g} minutes)",
        f"  orphan servers   {f.orphans}",
        *(f"  breach: {b}" for b in f.breaches),
        "",
        f"## verify: status {f.verify_status}: {f.verify_summary}",
        f"## store: {json.dumps(f.store)}",
        "",
        "## notes",
        *(f"  {n}" for n in f.notes[:30]),
        "",
        "## invariants",
        *(f"  {'MET   ' if ok else 'MISSED'} {name}" for name, ok in held.items()),
        "",
        f"## schedule (python -m bench.soak --minutes {f.minutes:g} --seed {f.seed} --clients {f.clients})",
        *(f"  {event.describe()}" for event in f.events),
    ]
    return "\n".join(lines)


def as_json(f: Figures) -> dict[str, Any]:
    out = dataclasses.asdict(f)
    out["events"] = [dataclasses.asdict(e) for e in f.events]
    out["invariants"] = verdicts(f)
    out["warm_share"] = f.warm_share()
    return out
