"""The bench's sections: one row each in ``TABLE``, which ``python -m bench`` runs in order.

Adding a section is one row here (its name for ``--only``, the header it prints, how it
runs, where its result goes): see "Adding a section" in ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from typing import Any, Protocol

from bench import (
    agents,
    defaults,
    goals,
    hybrid,
    launcher,
    library,
    nodes,
    price,
    rig,
    scale,
    scaling,
    shared_blocks,
    shared_store,
    swa,
)
from bench import footprint as footprint_mod
from bench import hashing as hashing_mod
from bench import proxy as proxy_mod
from bench import restart as restart_mod
from bench import restore as restore_mod
from bench import stall as stall_mod
from bench import swap as swap_mod
from bench import ttft as ttft_mod
from bench import turns as turns_mod


def say(text: str) -> None:
    """Progress, to stderr: stdout holds the results."""
    print(text, file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    sizes: list[int]
    io_reps: int
    ttft_reps: int
    restart_tokens: int
    restarts: int
    stall_tokens: int
    stall_seconds: float
    stall_rounds: int
    stall_period: float
    footprint_seconds: float
    file_mib: int
    hash_reps: int
    restore_reps: int
    checksum_mib: int


def plan(ns: argparse.Namespace) -> Plan:
    quick = bool(ns.quick)
    sizes = (
        [int(s) for s in ns.sizes.split(",")]
        if ns.sizes
        else ([1024, 2048] if quick else [1024, 2048, 4096, 8192, 12288])
    )
    return Plan(
        sizes=sizes,
        io_reps=2 if quick else 5,
        ttft_reps=1 if quick else 3,
        restart_tokens=2048 if quick else 4096,
        restarts=ns.restarts or (5 if quick else 20),
        stall_tokens=2048 if quick else 4096,
        stall_seconds=15.0 if quick else 25.0,
        stall_rounds=1 if quick else 4,
        stall_period=3.5,
        footprint_seconds=6.0 if quick else 30.0,
        file_mib=128 if quick else 1024,
        hash_reps=2 if quick else 3,
        restore_reps=3 if quick else 7,
        checksum_mib=128 if quick else 256,
    )


@dataclasses.dataclass(frozen=True, slots=True)
class Run:
    """What every section gets: the rig, the plan, ``--quick``, and the results judged at the end."""

    bed: rig.Rig
    plan: Plan
    quick: bool
    results: goals.Results


@dataclasses.dataclass(frozen=True, slots=True)
class Section:
    name: str
    """Its name for ``--only``."""
    title: str
    """The header printed above its tables."""
    measure: Callable[[Run], tuple[Any, str]]
    """Runs it: its result and the text printed under the header."""
    result: str | None = None
    """The field of ``goals.Results`` its result goes to, judged by ``goals.judge``."""
    verdicts: Callable[[Any], list[str]] | None = None
    """Its own verdict lines, for a section ``goals`` does not judge: a MISSED line fails the run."""


def _ttft(bed: rig.Rig, p: Plan) -> tuple[list[ttft_mod.Point], str]:
    points = ttft_mod.run(bed, p.sizes, io_reps=p.io_reps, reps=p.ttft_reps, say=say)
    return points, ttft_mod.table(points)


def _restart(bed: rig.Rig, p: Plan) -> tuple[list[restart_mod.Sample], str]:
    samples, tokens = restart_mod.run(bed, tokens=p.restart_tokens, restarts=p.restarts, say=say)
    return samples, f"snapshot of {tokens:,} tokens, {len(samples)} kill -9 restarts\n\n" + restart_mod.table(samples)


def _stall(bed: rig.Rig, p: Plan) -> tuple[list[stall_mod.Condition], str]:
    conds = stall_mod.run(
        bed, base_tokens=p.stall_tokens, seconds=p.stall_seconds, rounds=p.stall_rounds, period=p.stall_period, say=say
    )
    head = (
        f"slot 1 holds ~{p.stall_tokens:,} tokens and grows every {p.stall_period} s; "
        f"{p.stall_rounds} x {p.stall_seconds:.0f} s per condition, alternating; -np 2\n\n"
    )
    direct = stall_mod.p99_ratio(conds, stall_mod.DIRECT, stall_mod.SIDECAR)
    held = stall_mod.p99_ratio(conds, stall_mod.NONE, stall_mod.HELD)
    body = stall_mod.windows_table(conds) + "\n\n" + stall_mod.table(conds)
    return conds, head + body + (
        f"\n\np99, kept rounds: sidecar (hold off) / bench's direct saves {direct:.3f}; "
        f"sidecar (defaults: hold) / no saves {held:.3f}"
    )


def _footprint(bed: rig.Rig, p: Plan) -> tuple[list[footprint_mod.State], str]:
    states = footprint_mod.run(bed, seconds=p.footprint_seconds, say=say)
    head = (
        f'{p.footprint_seconds:.0f} s per state; CPU % is of one core (100% = one core busy); "bare loop" is a '
        "Python asyncio loop that only sleeps for the poll interval, run in the same window\n\n"
    )
    return states, head + footprint_mod.table(states)


def _scaling(bed: rig.Rig, p: Plan, points: list[ttft_mod.Point] | None) -> tuple[list[scaling.Rate], str]:
    parts = []
    if points:
        parts.append(
            "per size (direct save/restore of the slot, median of "
            f"{p.io_reps}; sha256 via hashlib.file_digest, page cache warm)\n\n" + scaling.sizes_table(points)
        )
    rates = scaling.disk_and_hash(bed.work, size_mib=p.file_mib, reps=p.hash_reps)
    biggest = max((pt.io.bytes for pt in points), default=45_000_000) if points else 45_000_000
    parts.append(scaling.rates_table(rates, snapshot_bytes=biggest, file_mib=p.file_mib, reps=p.hash_reps))
    return rates, "\n\n".join(parts)


def _restore(bed: rig.Rig, p: Plan, *, quick: bool) -> tuple[list[restore_mod.Measure], str]:
    measures = restore_mod.run(bed, quick=quick, reps=p.restore_reps, say=say)
    head = (
        f"-np 1; the slot erased before each restore; {p.restore_reps} of each, alternating, medians; "
        "the sidecar's POST /restore: /slots reads + checksum + the server's restore call\n\n"
    )
    return measures, head + restore_mod.table(measures)


def _hashing(bed: rig.Rig, p: Plan) -> tuple[hashing_mod.Checksums, str]:
    found = hashing_mod.measure(bed.work, mib=p.checksum_mib, reps=p.hash_reps)
    head = (
        f"a {p.checksum_mib} MiB file in the bench's scratch dir (the slot dirs' filesystem), best of {p.hash_reps}\n\n"
    )
    return found, head + hashing_mod.report(found)


class _Measures(Protocol):
    """A section module whose own ``measure`` runs it."""

    def measure(self, bed: rig.Rig, *, quick: bool, say: rig.Say) -> tuple[Any, str]: ...


def _own(module: _Measures) -> Callable[[Run], tuple[Any, str]]:
    return lambda r: module.measure(r.bed, quick=r.quick, say=say)


TABLE: tuple[Section, ...] = (
    Section("ttft", "1. TTFT after kill -9: cold re-prefill vs restored", lambda r: _ttft(r.bed, r.plan), "points"),
    Section(
        "restart",
        "2. Restart to restored (sidecar defaults: poll 1.0 s, 0.25 s while down)",
        lambda r: _restart(r.bed, r.plan),
        "restarts",
    ),
    Section(
        "stall",
        "3. Serving stall: inter-token gaps on slot 0 while slot 1 is snapshotted",
        lambda r: _stall(r.bed, r.plan),
        "stalls",
    ),
    Section("footprint", "4. Footprint: CPU share and RSS", lambda r: _footprint(r.bed, r.plan), "footprint"),
    Section(
        "scaling",
        "5. Scaling: snapshot size, save/restore, checksum vs disk",
        lambda r: _scaling(r.bed, r.plan, r.results.points),
        "rates",
    ),
    Section(
        "proxy",
        "6. Proxy (--proxy-listen): added latency and streamed token gaps",
        _own(proxy_mod),
        "proxy",
    ),
    Section(
        "restore",
        "7. Restore path: the sidecar's restore (check + call) vs the server's own restore call",
        lambda r: _restore(r.bed, r.plan, quick=r.quick),
        "restores",
    ),
    Section(
        "hashing", "8. Checksum vs disk read, and the cost of a commit", lambda r: _hashing(r.bed, r.plan), "checksums"
    ),
    Section(
        "library",
        "9. Conversation library: TTFT per turn, N conversations on 2 slots, vs llama-server alone",
        _own(library),
        verdicts=library.verdicts,
    ),
    Section(
        "shared",
        "10. Shared store: S3 clients on an object up and down (python -m bench.shared_store)",
        lambda r: shared_store.measure(mib=64 if r.quick else 200, reps=1 if r.quick else 2, say=say),
    ),
    Section(
        "agents",
        "11. Agents: time to the first streamed byte through the proxy, per API, vs direct",
        _own(agents),
        "agents",
    ),
    Section(
        "hybrid",
        "12. Hybrid models: reuse and time to first token per chat turn, alone vs beside vs proxy, and kill -9",
        _own(hybrid),
        "hybrid",
    ),
    Section(
        "price",
        "13. The proxy's price per turn: warm turns, first streamed byte, CPU, and the turn after a kill -9",
        _own(price),
        "price",
    ),
    Section(
        "scale",
        "14. Scale: agents at an 8B-class KV, slot files whole vs the block store, and kill -9",
        _own(scale),
        verdicts=scale.verdicts,
    ),
    Section(
        "nodes",
        "15. Nodes: two nodes behind HAProxy, the shipped config vs round robin, and a node's kill -9",
        _own(nodes),
        verdicts=nodes.verdicts,
    ),
    Section(
        "launcher",
        "16. Launcher mode after a kill -9: from the death vs beside with a restart loop, and who waits",
        _own(launcher),
        verdicts=launcher.verdicts,
    ),
    Section(
        "blocks",
        "17. Shared store: bytes moved per turn, blocks vs whole files, two nodes (python -m bench.shared_blocks)",
        _own(shared_blocks),
        verdicts=shared_blocks.verdicts,
    ),
    Section(
        "swap",
        "18. Swap speed: a conversation swapped into a slot from a whole file vs from the block store",
        _own(swap_mod),
        verdicts=swap_mod.verdicts,
    ),
    Section(
        "defaults",
        "19. The one command (llama-kv-sidecar run -- llama-server ...) vs llama-server alone, side by side "
        "(python -m bench.defaults)",
        _own(defaults),
        verdicts=defaults.verdicts,
    ),
    Section(
        "swa",
        "20. Sliding-window models without --swa-full: the turn after a kill -9 vs no crash",
        _own(swa),
        verdicts=swa.verdicts,
    ),
    Section(
        "turns",
        "21. The block store at chat-size turns: written and stored over the KV, RAM staging when idle",
        _own(turns_mod),
        verdicts=turns_mod.verdicts,
    ),
)

NAMES = tuple(s.name for s in TABLE)
