"""The goals of the benchmarks, judged on one run's results.

Each goal is a ratio or a distribution from the same run, never an absolute
wall-clock limit, so that a busy machine moves both sides of a comparison.

* TTFT: restored at least 100x faster than cold at about 8K tokens.
* Restart: the sidecar's p95 overhead (healthy → restored minus the server's
  own restore_ms) below one poll interval (1.0 s by default) plus 50 ms.
* Stall: p99 inter-token gap with the sidecar within 5% of without.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from bench import footprint, restart, rig, scaling, stall, ttft

SPEEDUP_GOAL = 100.0
SPEEDUP_AT = 8192
POLL_INTERVAL = 1.0
OVERHEAD_SLACK = 0.05
STALL_P99_GOAL = 1.05
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
        near = [p for p in r.points if abs(p.tokens - SPEEDUP_AT) <= SPEEDUP_AT * 0.1]
        if near:
            p = near[0]
            out.append(
                Verdict(
                    f"TTFT speed-up >= {SPEEDUP_GOAL:.0f}x at ~8K tokens",
                    f"{p.speedup:.0f}x at {p.tokens:,} tokens (cold {p.cold_s:.1f} s, restored "
                    f"{p.restored_s * 1000:.0f} ms)",
                    p.speedup >= SPEEDUP_GOAL,
                )
            )
        else:
            big = max(r.points, key=lambda p: p.tokens)
            out.append(
                Verdict(
                    f"TTFT speed-up >= {SPEEDUP_GOAL:.0f}x at ~8K tokens",
                    f"8K not run{' (--quick)' if quick else ''}; {big.speedup:.0f}x at {big.tokens:,}",
                    None,
                )
            )
    if r.restarts:
        over = [s.overhead_s for s in r.restarts]
        p95 = rig.percentile(over, 95)
        limit = POLL_INTERVAL + OVERHEAD_SLACK
        out.append(
            Verdict(
                f"restart overhead p95 < poll {POLL_INTERVAL:.1f} s + {OVERHEAD_SLACK * 1000:.0f} ms",
                f"p50 {rig.percentile(over, 50) * 1000:.0f} ms, p95 {p95 * 1000:.0f} ms over {len(over)} restarts",
                p95 < limit,
            )
        )
    if r.stalls:
        ratio = stall.p99_ratio(r.stalls)
        base, side = stall.pick(r.stalls, stall.NONE), stall.pick(r.stalls, stall.SIDECAR)
        few = min(len(base.gaps_ms), len(side.gaps_ms)) < MIN_GAPS
        noisy = stall.disturbed(r.stalls)
        out.append(
            Verdict(
                f"stall: p99 gap with sidecar <= {STALL_P99_GOAL:.2f}x without",
                f"{ratio:.3f}x (p99 {rig.percentile(side.gaps_ms, 99):.1f} vs "
                f"{rig.percentile(base.gaps_ms, 99):.1f} ms; {side.saves} saves)"
                + (f"; under {MIN_GAPS} gaps per condition: inconclusive" if few else "")
                + ("; no undisturbed round: inconclusive" if noisy else ""),
                None if few or noisy or math.isnan(ratio) else ratio <= STALL_P99_GOAL,
            )
        )
    if r.footprint:
        idle = r.footprint[0]
        out.append(
            Verdict(
                "footprint (no goal): sidecar idle at poll 1.0 s",
                f"{idle.sidecar_cpu * 100:.2f}% of a core ({idle.net_ms_per_poll:.2f} ms/poll above a bare "
                f"asyncio loop), RSS {idle.sidecar_rss / (1 << 20):.0f} MiB",
                None,
            )
        )
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


def table(verdicts: list[Verdict]) -> str:
    word = {True: "met", False: "MISSED", None: "-"}
    return rig.table(["goal", "measured", "verdict"], [[v.goal, v.measured, word[v.met]] for v in verdicts], left=True)
