"""The goals of the benchmarks, judged on one run's results.

Each goal is a ratio of two figures measured in the same run, never an
absolute wall-clock limit, so that a busy machine moves both sides of a
comparison.

* TTFT: the restored turn at least 100x faster than a cold re-prefill at
  about 8K tokens; prefill time grows with the prompt and a restored turn
  does not, so at a smaller largest size the bar is scaled down in proportion
  (25x at 2K).
* TTFT from healthy: what a user waits, from the restarted server answering
  /health to the restored turn's answer (the sidecar's detection and restore
  included), at least 2x faster than the cold turn at the largest size.
* Restart: the p95 of healthy → restored at most half the server's own
  start-up (kill -9 + start to healthy, median).
* Stall: p99 inter-token gap with the sidecar within 5% of without.
* Footprint: while the server streams, the sidecar's CPU at most 5% of the
  server's, and its RSS at most 25% of the server's, side by side.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from bench import footprint, restart, rig, scaling, stall, ttft

SPEEDUP_GOAL = 100.0
SPEEDUP_AT = 8192
FROM_HEALTHY_GOAL = 2.0
RESTART_GOAL = 0.5
"""p95 healthy -> restored over the median kill -9 + start -> healthy."""
STALL_P99_GOAL = 1.05
CPU_SHARE_GOAL = 0.05
"""Sidecar CPU over llama-server CPU while it streams."""
RSS_SHARE_GOAL = 0.25
"""Sidecar RSS over llama-server RSS."""
MIN_GAPS = 300
"""Fewer gaps per condition than this and a p99 is a handful of samples: the verdict is withheld."""


@dataclasses.dataclass(slots=True)
class Results:
    points: list[ttft.Point] | None = None
    restarts: list[restart.Sample] | None = None
    stalls: list[stall.Condition] | None = None
    footprint: list[footprint.State] | None = None
    rates: list[scaling.Rate] | None = None

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
        out.append(_stall(r.stalls))
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
    return out


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


def _stall(conds: list[stall.Condition]) -> Verdict:
    ratio = stall.p99_ratio(conds)
    base, side = stall.pick(conds, stall.NONE), stall.pick(conds, stall.SIDECAR)
    few = min(len(base.gaps_ms), len(side.gaps_ms)) < MIN_GAPS
    noisy = stall.disturbed(conds)
    return Verdict(
        f"stall: p99 gap with sidecar <= {STALL_P99_GOAL:.2f}x without",
        f"{ratio:.3f}x (p99 {rig.percentile(side.gaps_ms, 99):.1f} vs {rig.percentile(base.gaps_ms, 99):.1f} ms;"
        f" p50 {stall.p50_ratio(conds):.3f}x; {side.saves} saves)"
        + (f"; under {MIN_GAPS} gaps per condition: inconclusive" if few else "")
        + ("; every round's baseline disturbed: inconclusive" if noisy else ""),
        None if few or noisy or math.isnan(ratio) else ratio <= STALL_P99_GOAL,
    )


def _footprint(states: list[footprint.State]) -> list[Verdict]:
    busy = next((s for s in states if s.server_cpu and s.server_rss and "streaming" in s.name), None)
    if busy is None or busy.server_cpu is None or busy.server_rss is None:
        return [Verdict("footprint: sidecar beside a streaming server", "the streaming state was not measured", None)]
    cpu = busy.sidecar_cpu / busy.server_cpu
    rss = busy.sidecar_rss / busy.server_rss
    mib = 1 << 20
    return [
        Verdict(
            f"footprint: sidecar CPU <= {CPU_SHARE_GOAL:.0%} of llama-server's while it streams",
            f"{cpu:.2%} ({busy.sidecar_cpu * 100:.2f}% vs {busy.server_cpu * 100:.0f}% of a core)",
            cpu <= CPU_SHARE_GOAL,
        ),
        Verdict(
            f"footprint: sidecar RSS <= {RSS_SHARE_GOAL:.0%} of llama-server's",
            f"{rss:.1%} ({busy.sidecar_rss / mib:.0f} vs {busy.server_rss / mib:.0f} MiB)",
            rss <= RSS_SHARE_GOAL,
        ),
    ]


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
