"""The goals of the benchmarks, judged on one run's results.

Each goal compares two figures measured side by side in the same run, so
that a busy machine moves both sides of a comparison: a ratio, never an
absolute wall-clock limit, except the proxy's, whose bar is the time it adds
to a request (its latency minus the direct one's, under 1 ms).

* TTFT: the restored turn at least 100x faster than a cold re-prefill at
  about 8K tokens; prefill time grows with the prompt and a restored turn
  does not, so at a smaller largest size the bar is scaled down in proportion
  (25x at 2K).
* TTFT from healthy: what a user waits, from the restarted server answering
  /health to the restored turn's answer (the sidecar's detection and restore
  included), at least 2x faster than the cold turn at the largest size.
* Restart: the p95 of healthy → restored at most half the server's own
  start-up (kill -9 + start to healthy, median).
* Stall: the p99 inter-token gap with the sidecar saving while another
  slot generates (`--save-hold-seconds 0`) within 2% of the same saves made
  directly by the bench; with its defaults (the hold) within 5% of no saves
  at all, and none of its saves landing during another slot's generation
  (the held saves are made once the stream ends).
* Footprint: while the server streams, and while it streams on one slot as
  the sidecar saves another, the sidecar's CPU at most 5% of the server's;
  its RSS at most 25% of the server's in every state the server is up.
* Restore: the sidecar's restore (slot reads, checksum, call) at most 1.2x
  the server's own restore call of the same file, at today's size and at
  200 MB or more.
* Checksum: the sidecar's checksum (xxh3-128) of a file in the page cache at
  least as fast as the disk's O_DIRECT read: the check is never the
  bottleneck of a restore.
* Proxy: the targets of ``bench.proxy`` (under 1 ms added at p50 for a
  non-streamed request; the p99 token gap within noise of the direct one; a
  streamed request held at the gate or in a long prefill gets its first byte
  within 100 ms).
* Agents: the time to the first streamed byte of a warm agent turn through
  the proxy (routed: converted, templated, tokenized) at most 1.25x the
  direct one at p50, for Chat Completions, Anthropic Messages and Responses.
* Hybrid: the targets of ``bench.hybrid`` (on qwen35, lfm2 and the dense
  test model, two chats on one slot: >= 90% of the previous prompt reused on
  every later turn through the proxy and after a kill -9, beside after a
  kill -9 too; warm turns beside and through the proxy at most 1.25x
  llama-server alone's time to first token).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from bench import agents as agents_mod
from bench import footprint, hashing, hybrid_chat, price_figures, restart, restore, rig, scaling, stall, ttft
from bench import hybrid as hybrid_mod
from bench import price as price_mod
from bench import proxy as proxy_mod

SPEEDUP_GOAL = 100.0
SPEEDUP_AT = 8192
FROM_HEALTHY_GOAL = 2.0
RESTART_GOAL = 0.5
"""p95 healthy -> restored over the median kill -9 + start -> healthy."""
STALL_P99_GOAL = 1.05
"""p99 gap with the sidecar (defaults: the hold) over no saves."""
STALL_DIRECT_GOAL = 1.02
"""p99 gap with the sidecar saving during generation (hold off) over the same saves made directly."""
CPU_SHARE_GOAL = 0.05
"""Sidecar CPU over llama-server CPU while it streams."""
RSS_SHARE_GOAL = 0.25
"""Sidecar RSS over llama-server RSS."""
RESTORE_GOAL = 1.2
"""The sidecar's restore over the server's own restore call of the same file."""
CHECKSUM_GOAL = 1.0
"""The sidecar's checksum of a cached file over the disk's O_DIRECT read."""
MIN_GAPS = 300
"""Fewer gaps per condition than this and a p99 is a handful of samples: the verdict is withheld."""


@dataclasses.dataclass(slots=True)
class Results:
    points: list[ttft.Point] | None = None
    restarts: list[restart.Sample] | None = None
    stalls: list[stall.Condition] | None = None
    footprint: list[footprint.State] | None = None
    rates: list[scaling.Rate] | None = None
    restores: list[restore.Measure] | None = None
    checksums: hashing.Checksums | None = None
    proxy: proxy_mod.Result | None = None
    agents: list[agents_mod.Api] | None = None
    hybrid: hybrid_chat.Result | None = None
    price: price_figures.Result | None = None

    def as_json(self) -> dict[str, Any]:
        def dump(value: Any) -> Any:
            if value is None:
                return None
            if isinstance(value, list | tuple):
                return [dump(v) for v in value]
            return dataclasses.asdict(value)

        return {
            "ttft": dump(self.points),
            "restart": dump(self.restarts),
            "stall": dump(self.stalls),
            "footprint": dump(self.footprint),
            "checksum_vs_disk": dump(self.rates),
            "restore": dump(self.restores),
            "checksums": dump(self.checksums),
            "proxy": dump(self.proxy),
            "agents": dump(self.agents),
            "hybrid": dump(self.hybrid),
            "price": dump(self.price),
        }


def results_from_json(raw: dict[str, Any]) -> Results:
    """Rebuild the results a run wrote to `results.json` (for `--replot`)."""

    def point(d: dict[str, Any]) -> ttft.Point:
        return ttft.Point(**{**d, "io": ttft.SlotIO(**d["io"]), "pressure": tuple(d["pressure"])})

    def condition(d: dict[str, Any]) -> stall.Condition:
        return stall.Condition(d["name"], [stall.Window(**w) for w in d["windows"]], d["save_server_ms"])

    return Results(
        points=[point(d) for d in raw["ttft"]] if raw.get("ttft") else None,
        restarts=[restart.Sample(**d) for d in raw["restart"]] if raw.get("restart") else None,
        stalls=[condition(d) for d in raw["stall"]] if raw.get("stall") else None,
        footprint=[footprint.State(**d) for d in raw["footprint"]] if raw.get("footprint") else None,
        rates=[scaling.Rate(**d) for d in raw["checksum_vs_disk"]] if raw.get("checksum_vs_disk") else None,
        restores=[restore.Measure(**d) for d in raw["restore"]] if raw.get("restore") else None,
        checksums=hashing.Checksums(
            **{**raw["checksums"], "commits": {k: tuple(v) for k, v in raw["checksums"]["commits"].items()}}
        )
        if raw.get("checksums")
        else None,
        proxy=proxy_mod.Result(
            [proxy_mod.Latency(**d) for d in raw["proxy"]["latencies"]],
            [proxy_mod.Gaps(**d) for d in raw["proxy"]["gaps"]],
            [proxy_mod.Held(**d) for d in raw["proxy"].get("held", [])],
        )
        if raw.get("proxy")
        else None,
        agents=[agents_mod.Api(**d) for d in raw["agents"]] if raw.get("agents") else None,
        price=price_mod.from_json(raw["price"]) if raw.get("price") else None,
    )


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    goal: str
    measured: str
    met: bool | None
    """None: not measured in this run."""


def judge(r: Results, *, quick: bool) -> list[Verdict]:
    out = []
    if r.points:
        out += _ttft(r.points, quick=quick)
    if r.restarts:
        out.append(_restart(r.restarts))
    if r.stalls:
        out += _stall(r.stalls, quick=quick)
    if r.footprint:
        out += _footprint(r.footprint)
    if r.rates:
        by = {rate.name: rate.gb_per_s for rate in r.rates}
        warm = next((v for k, v in by.items() if "warm" in k), math.nan)
        direct = next((v for k, v in by.items() if "O_DIRECT" in k), math.nan)
        out.append(
            Verdict(
                "checksum vs disk (no goal)",
                f"sha256 {warm:.2f} GB/s (page cache) vs O_DIRECT read {direct:.2f} GB/s",
                None,
            )
        )
    if r.restores:
        out += [_restore(m, quick=quick) for m in r.restores]
    if r.checksums:
        out.append(_checksum(r.checksums))
    if r.proxy:
        out += [Verdict(goal, measured, met) for goal, measured, met in proxy_mod.judged(r.proxy, quick=quick)]
    if r.agents:
        out += [Verdict(goal, measured, met) for goal, measured, met in agents_mod.judged(r.agents, quick=quick)]
    if r.hybrid:
        out += [Verdict(goal, measured, met) for goal, measured, met in hybrid_mod.judged(r.hybrid)]
    if r.price:
        out += [Verdict(goal, measured, met) for goal, measured, met in price_mod.judged(r.price)]
    return out


def _restore(m: restore.Measure, *, quick: bool) -> Verdict:
    rounds = [a / b for a, b in zip(m.restart_ms, m.restart_direct_ms, strict=False)]
    return Verdict(
        f"restore of {m.bytes / 1e6:.0f} MB ({m.tokens:,} tokens) after a restart: the sidecar's "
        f"<= {RESTORE_GOAL:.1f}x the server's own call",
        f"{m.ratio:.2f}x (sidecar {rig.median(m.restart_ms):.1f} ms from its slot read to the call's end, "
        f"file checked while the server loaded in {rig.median(m.precheck_ms):.0f} ms; server call "
        f"{rig.median(m.restart_direct_ms):.1f} ms, restore_ms {rig.median(m.restart_direct_server_ms):.1f}; "
        "on demand, "
        f"the check in the round: {m.demand_ratio:.2f}x; per restore {', '.join(f'{v:.2f}' for v in rounds)})",
        rig.decide(m.ratio, RESTORE_GOAL, rounds=rounds, quick=quick),
    )


def _checksum(c: hashing.Checksums) -> Verdict:
    name = hashing.ALGORITHM
    return Verdict(
        f"checksum: {name} of a cached file >= {CHECKSUM_GOAL:.1f}x the disk's O_DIRECT read",
        f"{c.current:.2f}x ({c.cached[name]:,.0f} vs {c.direct:,.0f} MB/s; sha256 {c.cached['sha256']:,.0f} MB/s)",
        None if math.isnan(c.current) else c.current >= CHECKSUM_GOAL,
    )


def _ttft(points: list[ttft.Point], *, quick: bool) -> list[Verdict]:
    near = [p for p in points if abs(p.tokens - SPEEDUP_AT) <= SPEEDUP_AT * 0.1]
    p = near[0] if near else max(points, key=lambda p: p.tokens)
    bar = SPEEDUP_GOAL * min(1.0, p.tokens / SPEEDUP_AT)
    scaled = "" if near else f" (scaled from {SPEEDUP_GOAL:.0f}x at 8K: 8K not run{' with --quick' if quick else ''})"
    return [
        Verdict(
            f"TTFT speed-up >= {bar:.0f}x at {p.tokens:,} tokens{scaled}",
            f"{p.speedup:.0f}x (cold {p.cold_s:.2f} s, restored {p.restored_s * 1000:.0f} ms)",
            p.speedup >= bar,
        ),
        Verdict(
            f"TTFT from healthy >= {FROM_HEALTHY_GOAL:.0f}x at {p.tokens:,} tokens",
            f"{p.speedup_from_healthy:.1f}x (cold {p.cold_s:.2f} s; wait for the restore + restored turn "
            f"{p.from_healthy_s:.3f} s)",
            p.speedup_from_healthy >= FROM_HEALTHY_GOAL,
        ),
    ]


def _restart(samples: list[restart.Sample]) -> Verdict:
    waits = [s.healthy_to_restored_s for s in samples]
    load = rig.median([s.load_s for s in samples])
    ratio = rig.percentile(waits, 95) / load
    return Verdict(
        f"restart: p95 healthy->restored <= {RESTART_GOAL:.1f}x the server's own start-up",
        f"{ratio:.2f}x (p95 {rig.percentile(waits, 95) * 1000:.0f} ms, p50 {rig.percentile(waits, 50) * 1000:.0f} ms;"
        f" start-up median {load:.2f} s; {len(samples)} restarts)",
        ratio <= RESTART_GOAL,
    )


def _stall(conds: list[stall.Condition], *, quick: bool) -> list[Verdict]:
    base, direct = stall.pick(conds, stall.NONE), stall.pick(conds, stall.DIRECT)
    side, held = stall.pick(conds, stall.SIDECAR), stall.pick(conds, stall.HELD)
    few = min(len(c.gaps_ms) for c in conds) < MIN_GAPS
    noisy = stall.disturbed(conds)
    caveat = (f"; under {MIN_GAPS} gaps per condition: inconclusive" if few else "") + (
        "; every round's baseline disturbed: inconclusive" if noisy else ""
    )

    def p99(c: stall.Condition) -> float:
        return rig.percentile(c.gaps_ms, 99)

    def verdict(ratio: float, bar: float, rounds: list[float]) -> bool | None:
        return None if few or noisy else rig.decide(ratio, bar, rounds=rounds, quick=quick)

    vs_direct = stall.p99_ratio(conds, stall.DIRECT, stall.SIDECAR)
    vs_none = stall.p99_ratio(conds, stall.NONE, stall.HELD)
    direct_rounds = stall.round_p99_ratios(conds, stall.DIRECT, stall.SIDECAR)
    none_rounds = stall.round_p99_ratios(conds, stall.NONE, stall.HELD)

    def rounds_said(rounds: list[float]) -> str:
        return f"; per round {', '.join(f'{v:.3f}' for v in rounds)}"

    return [
        Verdict(
            f"stall: p99 gap with sidecar (hold off) <= {STALL_DIRECT_GOAL:.2f}x the same saves made directly",
            f"{vs_direct:.3f}x (p99 {p99(side):.1f} vs {p99(direct):.1f} ms; no saves {p99(base):.1f} ms;"
            f" {side.saves} vs {direct.saves} saves{rounds_said(direct_rounds)})" + caveat,
            verdict(vs_direct, STALL_DIRECT_GOAL, direct_rounds),
        ),
        Verdict(
            f"stall: p99 gap with sidecar (defaults: hold) <= {STALL_P99_GOAL:.2f}x no saves",
            f"{vs_none:.3f}x (p99 {p99(held):.1f} vs {p99(base):.1f} ms{rounds_said(none_rounds)})" + caveat,
            verdict(vs_none, STALL_P99_GOAL, none_rounds),
        ),
        Verdict(
            "stall: no save lands during another slot's generation with the hold, and the held saves are made",
            f"{held.during_generation} of {held.saves} with the hold ({held.after_stream} made once the stream "
            f"ended) vs {side.during_generation} of {side.saves} without",
            None
            if not side.during_generation
            else held.during_generation == 0 and held.after_stream >= sum(1 for w in held.windows if w.kept),
        ),
    ]


def _footprint(states: list[footprint.State]) -> list[Verdict]:
    out = []
    mib = 1 << 20
    for name in (footprint.STREAMING, footprint.SAVING):
        busy = next((s for s in states if s.name == name), None)
        if busy is None or busy.cpu_share is None:
            out.append(Verdict(f"footprint: {name}", "not measured", None))
            continue
        out.append(
            Verdict(
                f"footprint: sidecar CPU <= {CPU_SHARE_GOAL:.0%} of llama-server's ({name})",
                f"{busy.cpu_share:.2%} ({busy.sidecar_cpu * 100:.2f}% vs "
                f"{(busy.server_cpu or 0) * 100:.0f}% of a core)",
                busy.cpu_share <= CPU_SHARE_GOAL,
            )
        )
    up = [s for s in states if s.rss_share is not None]
    if up:
        worst = max(up, key=lambda s: s.rss_share or 0.0)
        share = worst.rss_share or 0.0
        out.append(
            Verdict(
                f"footprint: sidecar RSS <= {RSS_SHARE_GOAL:.0%} of llama-server's in every state",
                f"at most {share:.1%} ({worst.name}: {worst.sidecar_rss / mib:.0f} vs "
                f"{(worst.server_rss or 0) / mib:.0f} MiB; peak {max(s.sidecar_hwm for s in states) / mib:.0f} MiB)",
                share <= RSS_SHARE_GOAL,
            )
        )
    return out


def lines(verdicts: list[Verdict]) -> list[str]:
    """One line per goal: MET, MISSED, or why there is no verdict."""
    word = {True: "MET", False: "MISSED", None: "NO VERDICT"}
    return [f"{word[v.met]}: {v.goal}: {v.measured}" for v in verdicts if v.met is not None or "no goal" not in v.goal]


def exit_code(verdicts: list[Verdict]) -> int:
    """1 when a goal was missed, else 0."""
    return 1 if any(v.met is False for v in verdicts) else 0


def table(verdicts: list[Verdict]) -> str:
    word = {True: "met", False: "MISSED", None: "-"}
    return rig.table(["goal", "measured", "verdict"], [[v.goal, v.measured, word[v.met]] for v in verdicts], left=True)
