"""What the status page shows, as plain values: the view-model. Pure code.

:func:`build` turns what the sidecar knows (the engine's frozen
:class:`report.Status`, the library's manifests, the disk figures, a few
metric sums read from the registry, the history ring) into text and
numbers ready to print; :mod:`sidecar.app.page` only lays them out and
escapes them. Nothing of a conversation is shown: counts, sizes, times and
the short hash of its token chain (``manifest.Index.key``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence

from sidecar.app import history
from sidecar.core import events, outcomes
from sidecar.engine import lifecycle, report
from sidecar.launch import supervisor
from sidecar.restore import restorer
from sidecar.snapshots import manifest, store

LIBRARY_ROWS = 50
"""Conversations listed, most recently used first (the page says how many more there are)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Inputs:
    """Everything :func:`build` reads; gathered by the HTTP handler."""

    status: report.Status
    library: Sequence[tuple[manifest.Manifest, float]]
    """The library's snapshots with their last use (Unix time)."""
    usage: store.Usage
    max_bytes: int
    """--max-bytes (0: no cap)."""
    min_free_bytes: int
    """--min-free-bytes: a save below it deletes the least recently used snapshots first, or is skipped."""
    figures: Mapping[str, float]
    """Metric sums by key, as /metrics shows them (see ``figures.SUMS``)."""
    samples: tuple[history.Sample, ...]
    now: float
    """Unix time of the page."""
    shared: str | None = None
    """The shared store, described without credentials; None when off."""
    waiting: frozenset[str] = frozenset()
    """Files still waiting for their upload to the shared store."""
    version: str = ""
    launcher: supervisor.ChildStatus | None = None
    """Launcher mode: the llama-server the sidecar started; None beside a server run elsewhere."""
    staging: tuple[str, str, str] = ("", "", "")
    """The slot dir llama-server saves into, where it is (``ram``, ``disk``, ``given`` or ""), and the cost of
    staging on disk ("" when none)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Row:
    cells: tuple[str, ...]
    tone: str = ""
    """"good", "bad", "wait" or "": how the row is coloured."""


@dataclasses.dataclass(frozen=True, slots=True)
class Figure:
    """A headline number; ``key`` names it in the HTML (``data-figure``), ``value`` is the exact number."""

    key: str
    label: str
    text: str
    value: float
    note: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class Chart:
    title: str
    points: tuple[history.Point, ...]
    unit: str
    """"count", "share" (0-1) or "seconds"."""
    bars: bool


@dataclasses.dataclass(frozen=True, slots=True)
class Page:
    state: str
    """"up", "loading", "down", ... as a word."""
    tone: str
    problems: tuple[str, ...]
    server: tuple[tuple[str, str], ...]
    figures: tuple[Figure, ...]
    slots: tuple[Row, ...]
    acts: tuple[Row, ...]
    last_round: tuple[Row, ...]
    library: tuple[Row, ...]
    library_more: int
    disk: tuple[tuple[str, str], ...]
    charts: tuple[Chart, ...]
    generated: str
    version: str


def seconds_text(seconds: float) -> str:
    """1.4 s, 12 s, 3 min 20 s, 2 h 05 min."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"


def bytes_text(size: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size:.0f} B"


def ago_text(then: float, now: float) -> str:
    return "just now" if now - then < 1 else f"{seconds_text(now - then)} ago"


def clock_text(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at))


def _server(st: report.Status, obs: events.Observation | None) -> tuple[tuple[str, str], ...]:
    rows: list[tuple[str, str]] = [("URL", st.server_url)]
    ident = st.identity
    if ident is not None:
        for field in dataclasses.fields(ident):  # every field /status has, a memory kind included when known
            value = getattr(ident, field.name)
            if value is None or field.name == "adapters":
                continue
            if field.name == "model_size" and isinstance(value, int):
                text = bytes_text(value)
            elif field.name == "model_params" and isinstance(value, int):
                text = f"{value / 1e6:,.0f} M"
            else:
                text = str(value)
            rows.append((field.name.replace("_", " "), text))
        if ident.adapters:
            rows.append(("adapters", ", ".join(f"{a.path} (scale {a.scale:g})" for a in ident.adapters)))
    if obs is not None and obs.sleeping:
        rows.append(("asleep", "yes (--sleep-idle-seconds): its slots are empty until a request wakes it"))
    if st.link_ok is not None:
        rows.append(("slot dir shared with the server", "yes" if st.link_ok else "NO: " + st.link_problem))
    return tuple(rows)


def _launcher(child: supervisor.ChildStatus | None, now: float) -> tuple[tuple[str, str], ...]:
    """Launcher mode: the server process the sidecar started, its starts and its last end."""
    if child is None:
        return ()
    pid = f", pid {child.pid}" if child.pid is not None else ""
    rows = [("started by the sidecar", f"{child.program}: {child.state.value}{pid}, {child.starts} start(s)")]
    if child.last_exit and child.last_exit_at is not None:
        rows.append(("last end", f"{child.last_exit} ({child.last_cause}), {ago_text(child.last_exit_at, now)}"))
    return tuple(rows)


def _figures(inputs: Inputs) -> tuple[Figure, ...]:
    f, st = inputs.figures, inputs.status
    saved = f.get("prefill_saved_seconds", 0.0)
    rate = st.saved.rate
    note = (
        f"{f.get('prefill_saved_tokens', 0.0):,.0f} tokens not prefilled again, at {rate:,.0f} tokens/s"
        if rate is not None
        else "no prefill rate measured yet"
    )
    if st.saved.unpriced_tokens:
        note += f"; {st.saved.unpriced_tokens:,} tokens wait for a measured rate"
    ok = f.get("restores_ok", 0.0)
    tried = f.get("restores", 0.0)
    effective, ineffective = f.get("verified_effective", 0.0), f.get("verified_ineffective", 0.0)
    return (
        Figure("saved_seconds", "Prefill time saved", seconds_text(saved), saved, note),
        Figure(
            "restores_ok", "Restores", f"{ok:.0f}", ok, f"ok, of {tried:.0f} attempts (restore rounds' slots and swaps)"
        ),
        Figure(
            "verified_effective",
            "Effective",
            f"{effective:.0f}",
            effective,
            f"{ineffective:.0f} ineffective (the next task re-prefilled)",
        ),
        Figure("swaps", "Swaps", f"{f.get('swaps', 0.0):.0f}", f.get("swaps", 0.0), "library snapshots swapped in"),
        Figure("snapshots_ok", "Snapshots", f"{f.get('snapshots_ok', 0.0):.0f}", f.get("snapshots_ok", 0.0), "saved"),
        Figure("restarts", "Restarts seen", f"{f.get('restarts', 0.0):.0f}", f.get("restarts", 0.0)),
    )


def _slots(st: report.Status, now: float) -> tuple[Row, ...]:
    obs = st.observation
    if obs is None or obs.slots is None:
        return ()
    since = dict(st.slot_since)
    held: dict[int, str] = {}
    for done in st.recent:  # the newest restore or swap into a slot, while it still holds what it put there
        held[done.slot] = f"{done.by.value} of {done.file}"
    rows = []
    for view in obs.slots:
        if view.processing:
            state, tone = "processing", "wait"
        elif view.empty:
            state, tone = "empty", ""
        else:
            state, tone = "idle", "good"
        changed = since.get(view.id)
        rows.append(
            Row(
                (
                    str(view.id),
                    state,
                    f"{view.tokens:,} / {view.n_ctx:,}",
                    held.get(view.id, "") if not view.empty else "",
                    ago_text(changed, now) if changed is not None else "",
                ),
                tone,
            )
        )
    return tuple(rows)


def _verdict(done: restorer.Done) -> tuple[str, str]:
    verdict = done.verdict
    if verdict is outcomes.Verification.EFFECTIVE:
        return "effective", "good"
    if verdict is outcomes.Verification.INEFFECTIVE:
        return "ineffective", "bad"
    return "waiting for the slot's next task", "wait"


def _acts(st: report.Status, now: float) -> tuple[Row, ...]:
    rows = []
    for done in reversed(st.recent):
        verdict, tone = _verdict(done)
        saved = seconds_text(done.saved_seconds) if done.saved_seconds is not None else ""
        rows.append(
            Row(
                (
                    ago_text(done.at, now),
                    done.by.value,
                    str(done.slot),
                    f"{done.tokens:,}",
                    f"{done.seconds * 1000:.0f} ms",
                    verdict,
                    f"{done.reused_tokens:,}" if done.verdict is not None else "",
                    saved,
                ),
                tone,
            )
        )
    return tuple(rows)


def _last_round(st: report.Status, now: float) -> tuple[Row, ...]:
    return tuple(
        Row(
            (ago_text(r.at, now), str(r.slot), r.result.value, f"{r.tokens:,}" if r.tokens else "", r.detail),
            "good" if r.result is outcomes.RestoreOutcome.OK else "",
        )
        for r in st.last_restore
    )


def _library(inputs: Inputs) -> tuple[tuple[Row, ...], int]:
    ordered = sorted(inputs.library, key=lambda pair: -pair[1])
    rows = []
    for record, used in ordered[:LIBRARY_ROWS]:
        key = record.index.key if record.index is not None else ""
        if inputs.shared is None:
            where = "local"
        elif record.file in inputs.waiting:
            where = "local (upload pending)"
        else:
            where = "local + shared"
        rows.append(
            Row(
                (
                    key,
                    str(record.slot),
                    f"{record.tokens:,}",
                    bytes_text(record.bytes),
                    ago_text(used, inputs.now),
                    where,
                )
            )
        )
    return tuple(rows), max(0, len(ordered) - LIBRARY_ROWS)


def _disk(inputs: Inputs) -> tuple[tuple[str, str], ...]:
    usage = inputs.usage
    if usage.problem:
        return (("problem", usage.problem),)
    cap = f" of {bytes_text(inputs.max_bytes)} (--max-bytes)" if inputs.max_bytes else " (no --max-bytes cap)"
    share = f", {usage.used_bytes / inputs.max_bytes:.0%}" if inputs.max_bytes else ""
    rows = [
        ("used", f"{bytes_text(usage.used_bytes)}{cap}{share}"),
        ("snapshots", f"{usage.snapshot_files}"),
        (
            "free",
            f"{bytes_text(usage.free_bytes)}; kept above {bytes_text(inputs.min_free_bytes)} by deleting the least "
            "recently used snapshots, else saves stop",
        ),
    ]
    if usage.represented_bytes:
        rows.append(
            (
                "block store",
                f"{bytes_text(usage.unique_bytes)} of blocks hold {bytes_text(usage.represented_bytes)} of snapshots "
                f"({usage.represented_bytes / max(usage.unique_bytes, 1):.1f}x: what conversations share is kept once)",
            )
        )
    slot_dir, where, cost = inputs.staging
    if where:
        said = {"ram": "in RAM (a tmpfs)", "disk": "on disk", "given": "--slot-dir"}.get(where, where)
        rows.append(("staging", f"{said}: {slot_dir}" + (f"; {cost}" if cost else "")))
    if inputs.shared is not None:
        rows.append(("shared store", f"{inputs.shared}; {len(inputs.waiting)} upload(s) pending"))
    return tuple(rows)


def _charts(inputs: Inputs) -> tuple[Chart, ...]:
    f = inputs.figures
    now = history.Sample(
        at=inputs.now,
        restores=f.get("restores_ok", 0.0),
        saved_seconds=f.get("prefill_saved_seconds", 0.0),
        prompt_tokens=f.get("server_prompt_tokens"),
        cached_tokens=f.get("server_cached_tokens"),
    )
    samples = (*inputs.samples, now)
    return (
        Chart("Restores and swaps per minute", tuple(history.restores(samples)), "count", bars=True),
        Chart("Prompt tokens from the KV cache", tuple(history.hit_rate(samples)), "share", bars=True),
        Chart("Prefill time saved", tuple(history.saved(samples)), "seconds", bars=False),
    )


def build(inputs: Inputs) -> Page:
    st = inputs.status
    obs = st.observation
    state = obs.health.value if obs is not None else "unknown"
    if obs is not None and obs.health is events.Health.OK and obs.sleeping:
        state = "asleep"
    problems = []
    if obs is not None and obs.problem:
        problems.append(obs.problem)
    if st.restore_gate:
        problems.append(lifecycle.problem(st.restore_gate))
    if inputs.launcher is not None and inputs.launcher.problem:
        problems.append(inputs.launcher.problem)
    library, more = _library(inputs)
    return Page(
        state=state,
        tone="good" if state == "ok" else "bad" if state in ("down", "unknown") else "wait",
        problems=tuple(problems),
        server=_server(st, obs) + _launcher(inputs.launcher, inputs.now),
        figures=_figures(inputs),
        slots=_slots(st, inputs.now),
        acts=_acts(st, inputs.now),
        last_round=_last_round(st, inputs.now),
        library=library,
        library_more=more,
        disk=_disk(inputs),
        charts=_charts(inputs),
        generated=clock_text(inputs.now),
        version=inputs.version,
    )
