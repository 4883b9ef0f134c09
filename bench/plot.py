"""One PNG with a panel per benchmark that produced data.

(a) next-turn time after a kill -9 vs prompt tokens, cold and restored
(log y); (b) restart → restored per restart; (c) the distribution of
inter-token gaps of the streaming client with and without the sidecar
(complementary CDF, log y, so the tail is visible); (d) snapshot size and
save/restore time vs tokens.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib as mpl

mpl.use("Agg")

import matplotlib.pyplot as plt
from matplotlib import ticker
from matplotlib.axes import Axes

from bench import restart, rig, stall, ttft


def _ttft(ax: Axes, points: list[ttft.Point]) -> None:
    xs = [p.tokens for p in points]
    ax.plot(xs, [p.cold_s for p in points], "o-", color="tab:red", label="cold re-prefill")
    ax.plot(xs, [p.restored_s for p in points], "o-", color="tab:green", label="restored by the sidecar")
    for p in points:
        ax.annotate(
            f"{p.speedup:.0f}x",
            (p.tokens, p.restored_s),
            textcoords="offset points",
            xytext=(0, 8),
            ha="center",
            fontsize=8,
        )
    ax.set_yscale("log")
    ax.set_xlabel("conversation length (prompt tokens)")
    ax.set_ylabel("next turn, wall time (s)")
    ax.set_title("(a) time to answer after kill -9 + restart")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()


def _restart(ax: Axes, samples: list[restart.Sample], poll: float) -> None:
    series = {
        "healthy → restored": [s.healthy_to_restored_s * 1000 for s in samples],
        "sidecar since_healthy": [s.since_healthy_s * 1000 for s in samples],
        "slot read + call": [s.call_s * 1000 for s in samples],
        "server restore_ms": [s.server_ms for s in samples],
    }
    ax.boxplot(list(series.values()), tick_labels=list(series.keys()), showfliers=True)
    ax.axhline((poll + 0.05) * 1000, color="tab:red", linestyle="--", linewidth=1, label="goal: poll + 50 ms")
    ax.set_yscale("log")
    ax.set_ylabel("ms")
    ax.set_title(f"(b) restart → slot restored, {len(samples)} restarts")
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8)


def _stall(ax: Axes, conds: list[stall.Condition]) -> None:
    for cond, color in zip(conds, ("tab:blue", "tab:gray", "tab:orange", "tab:green"), strict=False):
        gaps = sorted(cond.gaps_ms)
        if not gaps:
            continue
        n = len(gaps)
        ax.step(
            gaps,
            [1 - i / n for i in range(n)],
            where="post",
            color=color,
            label=f"{cond.name} (p99 {rig.percentile(gaps, 99):.0f} ms)",
        )
    ax.set_yscale("log")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
    ax.xaxis.set_minor_formatter(ticker.FormatStrFormatter("%g"))
    ax.tick_params(axis="x", which="minor", labelsize=7)
    ax.set_xlabel("gap between streamed tokens (ms)")
    ax.set_ylabel("share of gaps longer")
    ax.set_title("(c) streaming on slot 0 while slot 1 is snapshotted")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def _scaling(ax: Axes, points: list[ttft.Point]) -> None:
    xs = [p.io.tokens for p in points]
    ax.plot(xs, [p.io.bytes / 1e6 for p in points], "s-", color="tab:purple", label="snapshot MB")
    ax.set_xlabel("tokens in the slot")
    ax.set_ylabel("snapshot size (MB)")
    ax.grid(True, alpha=0.3)
    right = ax.twinx()
    right.plot(xs, [rig.median(p.io.save_ms) for p in points], "o--", color="tab:brown", label="save_ms")
    right.plot(xs, [rig.median(p.io.restore_ms) for p in points], "o--", color="tab:olive", label="restore_ms")
    right.plot(xs, [rig.median(p.io.sha256_ms) for p in points], "o:", color="tab:gray", label="sha256 ms")
    right.set_ylabel("ms")
    ax.set_ylim(bottom=0)
    right.set_ylim(bottom=0)
    lines = ax.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="upper left")
    ax.set_title("(d) snapshot size and save/restore time")


def write(
    path: Path,
    *,
    title: str,
    points: list[ttft.Point] | None,
    samples: list[restart.Sample] | None,
    stalls: list[stall.Condition] | None,
    poll: float = 1.0,
) -> None:
    fig, axes = plt.subplots(2, 2, figsize=(14, 10))
    flat = list(axes.flat)
    if points:
        _ttft(flat[0], points)
        _scaling(flat[3], points)
    if samples:
        _restart(flat[1], samples, poll)
    if stalls:
        _stall(flat[2], stalls)
    for ax in flat:
        if not ax.has_data():
            ax.set_axis_off()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
