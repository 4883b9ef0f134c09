"""The conversation library: TTFT per turn for N conversations on 2 slots, through the proxy vs llama-server alone.

N chat conversations (a system prompt, a first message of about ``tokens``
tokens each, then one-line follow-ups) take turns, round after round, on a
llama-server with ``-np 2``, twice: with ``--cache-ram 0`` (the sidecar told
so with ``--server-cache-ram-bytes 0``), the RAM prompt cache off to stand
for conversations that do not fit it (a 27B model's 50K-token conversation
is about 2.7 GB) and for a server that restarted; and at the server's
defaults (its 8 GiB RAM prompt cache on, the sidecar's defaults too), where
the library must cost at most 3% per turn (a returning conversation comes
from that cache, not a file), on the bed's model and on one whose KV per
token is 8B-class (128 KiB: every swap through a file weighs what a user's
does). Each path gets
a fresh server and slot dir: llama-server alone, and the sidecar's proxy in
front of it (the library swaps each conversation back into a slot). The
paths run side by side: every path's server is up at once, and each
conversation takes its turn on one path after the other (which goes first
turns over), so that the machine's load, which moves a turn by more than
the 3% judged from one minute to the next, weighs on each alike; the
sidecar's own CPU time over the timed rounds is printed beside. A turn's
time is the wall time of a non-streamed ``/v1/chat/completions`` with
``max_tokens`` 1: time to first token, swaps and tokenization included.

At the defaults the proxy runs two ways, each side by side with a run of
llama-server alone of its own: the sidecar's defaults (whole slot files in its slot
dir) and ``--store-dir`` (the block store; the slot dir on a tmpfs,
``--staging``). After the timed rounds (once the sidecar has saved what the
slots hold) llama-server is ``kill -9``ed on each path, started again the
same way, and every conversation sends one more turn (through the proxy once
its ``/readyz`` answers 200): how many reused at least 99% of their previous
prompt (``usage.prompt_tokens_details.cached_tokens`` of the answer, the same
as ``timings.cache_n``), and that turn's median time. Its RAM prompt cache
gone, llama-server alone has none warm.

Printed per N: median turn time after the first round on each path, the
speed-up, the swaps and their mean cost next to the prefill each one saves
(llama-server alone's median turn at that N). The verdicts: for every N above
the slot count the library must beat llama-server alone without its RAM
cache, and cost at most :data:`DEFAULTS_PRICE` per turn at its defaults
(MET), and at the defaults through the proxy every conversation must come
back warm after the ``kill -9``: its turn reuses at least :data:`CACHED_GOAL`
of its previous prompt, or re-prefills what it did not reuse within the
sidecar's ``--max-unsaved-seconds`` (the crash loss a host allows a
conversation that left its slot for the server's RAM cache unsaved); the
share alone is reported beside, and so is llama-server alone; else MISSED
and exit status 1.

Run alone with ``python -m bench.library [--quick] [--defaults-only]
[--models tiny,wide] [--ways whole,blocks]``, or as the ``library`` section
of ``python -m bench``. The paths and their turns: :mod:`bench.library_paths`; here, the tables, the
verdicts, the plot and the options.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import matplotlib as mpl

mpl.use("Agg")

import matplotlib.pyplot as plt
from matplotlib import ticker

from bench import REPO_ROOT, rig
from bench.library_paths import BLOCKS, CACHED_GOAL, FIGURES, SLOTS, STAGING, TINY, TINY_SWA, WHOLE, WIDE, Point, run

DEFAULTS_PRICE = 1.03
"""Most a turn through the proxy may take, over llama-server alone, both at their defaults (RAM cache on)."""
DEFAULTS_TURNS = 60
"""Timed turns per path at the defaults, quick or not (in rounds of N, at least 3 of 20): a turn there is 0.1-0.3 s,
and the 3% judged is 3-9 ms, about what the median of 20 turns moves from run to run (two runs of llama-server
alone side by side differ by 1-3%; 18 turns at N=6 put it 6% off)."""
MODELS = {"tiny": TINY, "wide": WIDE, "swa": TINY_SWA}
"""``--models`` names."""


def table(points: list[Point], *, tokens: int) -> str:
    parts = [
        _table([p for p in points if not p.ram and p.model == model], tokens=tokens, model=model)
        for model in (TINY, WIDE)
        if any(not p.ram and p.model == model for p in points)
    ]
    parts += [
        _defaults_table([p for p in points if p.ram and p.model == model], tokens=tokens, model=model)
        for model in (TINY, WIDE)
        if any(p.ram and p.model == model for p in points)
    ]
    if any(p.proxy.figures for p in points):
        parts.append(_figures_table([p for p in points if p.proxy.figures]))
    return "\n\n".join(parts)


def _head(model: str, cache: str, tokens: int) -> str:
    return (
        f"{model}, {SLOTS} slots, {cache}; first messages of ~{tokens:,} tokens; turn = /v1/chat/completions, "
        "max_tokens 1, median over the rounds after the first\n\n"
    )


def _table(points: list[Point], *, tokens: int, model: str) -> str:
    rows = [
        (
            p.conversations,
            rig.median(p.direct.warm),
            rig.median(p.proxy.warm),
            p.speedup,
            p.proxy.swaps,
            p.swap_mean,
            rig.median(p.direct.warm) / p.swap_mean if p.proxy.swaps else float("nan"),
        )
        for p in points
    ]
    return _head(model, "--cache-ram 0", tokens) + rig.table(
        ["conversations", "alone s", "library s", "speed-up", "swaps", "swap s", "prefill saved / swap"], rows
    )


def _defaults_table(points: list[Point], *, tokens: int, model: str) -> str:
    rows = [
        (
            p.conversations,
            p.proxy.way or "-",
            rig.median(p.direct.warm),
            rig.median(p.proxy.warm),
            1 / p.speedup,
            p.paired_price,
            p.proxy.swaps,
            p.swap_mean,
            f"{p.direct.warm_after_kill}/{p.conversations}",
            f"{p.proxy.warm_after_kill}/{p.conversations}",
            rig.median(p.direct.after_kill_seconds),
            rig.median(p.proxy.after_kill_seconds),
            1000 * p.proxy.cpu / max(len(p.proxy.warm), 1),
        )
        for p in points
    ]
    return (
        _head(model, "the server's defaults (RAM prompt cache on)", tokens)
        + f"then kill -9 of llama-server, restarted the same way, and one more turn of each conversation: how many "
        f"reused at least {CACHED_GOAL:.0%} of their previous prompt, and that turn's median\n\n"
        + rig.table(
            [
                "conversations",
                "sidecar",
                "alone s",
                "library s",
                "library / alone",
                "per turn",
                "swaps",
                "swap s",
                "warm after kill alone",
                "library",
                "after kill alone s",
                "library s",
                "sidecar CPU ms/turn",
            ],
            rows,
        )
    )


def _figures_table(points: list[Point]) -> str:
    names = [name for name, _, _ in FIGURES]
    rows = [(p.label, *(_said(p.proxy.figures, name) for name in names)) for p in points]
    return (
        "The sidecar's counters at the defaults, at the kill -9 (before the slash) and at the end: conversations "
        "it indexed and counted on the RAM cache, left their slot unsaved, saves and their seconds, turns by where "
        "their prefix came from, restores\n\n" + rig.table(["point", *names], rows, left=True)
    )


def _said(figures: dict[str, float], name: str) -> str:
    before, end = figures.get(name, float("nan")), figures.get(name + " end", float("nan"))
    digits = 2 if name.endswith(" s") else 0
    return f"{before:.{digits}f}/{end:.{digits}f}"


def verdicts(points: list[Point]) -> list[str]:
    lines = []
    for p in points:
        if p.conversations <= SLOTS:
            continue
        figures = (
            f"{p.label}: median turn {rig.median(p.proxy.warm):.3f} s with the library, "
            f"{rig.median(p.direct.warm):.3f} s alone"
        )
        if not p.ram:
            lines.append(
                ("MET  " if p.speedup > 1.0 else "MISSED ")
                + f"library beats llama-server alone: {figures} ({p.speedup:.1f}x)"
            )
            continue
        price = p.paired_price
        goal = (
            f"at the server's defaults a turn costs at most {DEFAULTS_PRICE}x llama-server alone (the median of each "
            "turn's ratio to the same turn alone, taken side by side)"
        )
        lines.append(
            ("MET  " if price <= DEFAULTS_PRICE else "MISSED ")
            + f"{goal}: {figures} ({price:.3f}x; the ratio of the two medians {1 / p.speedup:.3f}x)"
        )
        if p.proxy.after_kill:
            lines += _kill_verdicts(p)
    return lines


def _kill_verdicts(p: Point) -> list[str]:
    """Through the proxy every conversation comes back warm after the kill -9; llama-server alone reported beside.

    The goal: each turn reuses :data:`CACHED_GOAL` of its previous prompt, or re-prefills no more than the
    crash loss the host allowed (``--max-unsaved-seconds``: a conversation may leave its slot for the
    server's RAM cache unsaved while its tail re-prefills within it). The share alone is reported beside.
    """
    proxy, direct = p.proxy, p.direct
    met = proxy.within_bound_after_kill == p.conversations
    alone = (
        f"llama-server alone {direct.warm_after_kill} of {p.conversations} at {CACHED_GOAL:.0%}, "
        f"median turn {rig.median(direct.after_kill_seconds):.3f} s"
    )
    return [
        ("MET  " if met else "MISSED ")
        + f"after a kill -9 at the defaults every conversation comes back warm through the proxy (at least "
        f"{CACHED_GOAL:.0%} of its previous prompt reused, or its re-prefill within --max-unsaved-seconds "
        f"{proxy.bound:g}): {p.label}: {proxy.within_bound_after_kill} of {p.conversations} (longest re-prefill "
        f"{max(proxy.after_kill_prefill):.2f} s), median turn {rig.median(proxy.after_kill_seconds):.3f} s; {alone}",
        f"REPORT after the kill -9, {p.label}: {proxy.warm_after_kill} of {p.conversations} reused at least "
        f"{CACHED_GOAL:.0%} of their previous prompt through the proxy (lowest {min(proxy.after_kill):.1%}; "
        "--max-unsaved-seconds 0 saves every conversation before it leaves its slot)",
    ]


def plot(points: list[Point], path: Path, title: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    for p, marker in zip(points, "os^D", strict=False):
        for run_, color in ((p.direct, "tab:red"), (p.proxy, "tab:green")):
            medians = [rig.median(r) for r in run_.rounds]
            ax.plot(range(len(medians)), medians, marker=marker, color=color,
                    label=f"N={p.conversations}, {run_.path}")  # fmt: skip
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
    ax.set_xlabel("round (0: every conversation's first turn)")
    ax.set_ylabel("median turn time (s, TTFT)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@dataclasses.dataclass(frozen=True, slots=True)
class Choice:
    """What a run measures (the flags of ``python -m bench.library``)."""

    sizes: tuple[int, ...] = (2, 6, 20)
    defaults_only: bool = False
    """Skip the ``--cache-ram 0`` part."""
    models: tuple[str, ...] = (TINY, WIDE)
    """Models of the part at the defaults."""
    ways: tuple[str, ...] = (WHOLE, BLOCKS)
    """The sidecar's ways at the defaults, each side by side with a run of llama-server alone of its own."""
    staging: Path = STAGING
    max_unsaved: str = ""
    """The sidecar's ``--max-unsaved-seconds`` at the defaults; empty: its own default."""


def measure(bed: rig.Rig, *, quick: bool, say: rig.Say, choice: Choice = Choice()) -> tuple[list[Point], str]:
    """``quick``: first messages of 400 tokens, one warm round (:data:`DEFAULTS_TURNS` at the defaults), and at
    the defaults N=6 only (the first N above the slot count)."""
    tokens = 400 if quick else 1000
    rounds = 1 if quick else 2
    points = [] if choice.defaults_only else run(bed, list(choice.sizes), tokens=tokens, rounds=rounds, say=say)
    at_defaults = [n for n in choice.sizes if n > SLOTS][: 1 if quick else None]
    for n in at_defaults:  # every model at one N before the next N: a run stopped early has each model's figures
        for model in choice.models:
            points += run(bed, [n], tokens=tokens, rounds=-(-DEFAULTS_TURNS // n), say=say, ram=True, model=model,
                          ways=choice.ways, staging=choice.staging, max_unsaved=choice.max_unsaved)  # fmt: skip
            say(f"so far:\n{table(points, tokens=tokens)}\n" + "\n".join(verdicts(points)))
    said = f"the sidecar ran with --max-unsaved-seconds {choice.max_unsaved}\n\n" if choice.max_unsaved else ""
    return points, said + table(points, tokens=tokens) + "\n\n" + "\n".join(verdicts(points))


def _names(text: str, known: dict[str, str]) -> tuple[str, ...]:
    picked = tuple(part.strip() for part in text.split(",") if part.strip())
    wrong = [name for name in picked if name not in known]
    if wrong or not picked:
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more of {', '.join(known)}, comma-separated")
    return tuple(known[name] for name in picked)


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, Choice]:
    parser = argparse.ArgumentParser(prog="python -m bench.library", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter prompts, one warm round, N=6 at the defaults")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "out", help="PNG, JSON and logs go here")
    parser.add_argument("--threads", type=int, default=2, help="llama-server -t (default 2)")
    parser.add_argument("--conversations", default="2,6,20", help="numbers of conversations to run (default 2,6,20)")
    parser.add_argument(
        "--defaults-only", action="store_true", help="only the part at llama-server's defaults (no --cache-ram 0)"
    )
    parser.add_argument(
        "--models",
        type=lambda text: _names(text, MODELS),
        default=(TINY, WIDE),
        help="models at the defaults: tiny (the bed's), wide (8B-class KV), swa (the bed's without --swa-full); "
        "default tiny,wide",
    )
    ways = {"whole": WHOLE, "blocks": BLOCKS}
    parser.add_argument(
        "--ways",
        type=lambda text: _names(text, ways),
        default=(WHOLE, BLOCKS),
        help="the sidecar's ways at the defaults: whole (its defaults: whole files in --slot-dir), blocks "
        "(--store-dir, the slot dir on --staging); default whole,blocks",
    )
    parser.add_argument(
        "--staging",
        type=Path,
        default=STAGING,
        help="the tmpfs the block store's slot dirs go under (default /dev/shm)",
    )
    parser.add_argument(
        "--max-unsaved-seconds",
        default="",
        metavar="SEC",
        help="the sidecar's --max-unsaved-seconds at the defaults (default: its own, 10; 0: every conversation "
        "saved before it leaves its slot, which the turn after a kill -9 needs to find it whole)",
    )
    ns = parser.parse_args(argv)
    sizes = tuple(int(n) for n in ns.conversations.split(","))
    return ns, Choice(sizes, ns.defaults_only, ns.models, ns.ways, ns.staging, ns.max_unsaved_seconds)


def main(argv: list[str] | None = None) -> int:
    ns, choice = parse(argv)
    bed = rig.Rig(log_dir=ns.out / f"logs-library-{time.strftime('%Y%m%d-%H%M%S')}", threads=ns.threads)
    try:
        before = rig.busy()
        points, body = measure(
            bed, quick=ns.quick, say=lambda text: print(text, file=sys.stderr, flush=True), choice=choice
        )
        print(f"## Conversation library\n({before} at start, {rig.busy()} at end)\n")
        print(body)
    finally:
        bed.close()
    raw: list[dict[str, Any]] = [dataclasses.asdict(p) for p in points]
    (ns.out / "library.json").write_text(json.dumps(raw, indent=2))
    if any(not p.ram for p in points):
        plot(
            [p for p in points if not p.ram],
            ns.out / "library.png",
            f"TTFT per turn, N conversations on {SLOTS} slots, --cache-ram 0",
        )
        print(f"wrote {ns.out / 'library.png'}")
    print(f"wrote {ns.out / 'library.json'}")
    return 1 if any(line.startswith("MISSED") for line in verdicts(points)) else 0


if __name__ == "__main__":
    sys.exit(main())
