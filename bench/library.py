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
front of it (the library swaps each conversation back into a slot). A turn's
time is the wall time of a non-streamed ``/v1/chat/completions`` with
``max_tokens`` 1: time to first token, swaps and tokenization included.

Printed per N: median turn time after the first round on each path, the
speed-up, the swaps and their mean cost next to the prefill each one saves
(llama-server alone's median turn at that N). The verdicts: for every N above
the slot count the library must beat llama-server alone without its RAM
cache, and cost at most :data:`DEFAULTS_PRICE` per turn at its defaults
(MET), else MISSED and exit status 1.

Run alone with ``python -m bench.library [--quick]``, or as the ``library``
section of ``python -m bench``.
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
from bench.beds import llamabed, net, widekv

SLOTS = 2
DIRECT, PROXY = "llama-server alone", "with the library"
DEFAULTS_PRICE = 1.03
"""Most a turn through the proxy may take, over llama-server alone, both at their defaults (RAM cache on)."""
TINY, WIDE = "gemma3-270m", "8B-class KV"
"""The bed's model, and the random-weight one whose KV is 128 KiB per token (``tests.support.widekv``)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Run:
    conversations: int
    path: str
    rounds: list[list[float]]
    """Seconds per turn, one list per round (round 0: every conversation's first turn)."""
    swaps: int = 0
    swap_seconds: float = 0.0

    @property
    def warm(self) -> list[float]:
        return [t for r in self.rounds[1:] for t in r]


@dataclasses.dataclass(frozen=True, slots=True)
class Point:
    conversations: int
    direct: Run
    proxy: Run
    ram: bool = False
    """At the server's defaults, its RAM prompt cache on (else ``--cache-ram 0``)."""
    model: str = TINY

    @property
    def speedup(self) -> float:
        return rig.median(self.direct.warm) / rig.median(self.proxy.warm)

    @property
    def swap_mean(self) -> float:
        return self.proxy.swap_seconds / self.proxy.swaps if self.proxy.swaps else float("nan")


class _Chat:
    def __init__(self, n: int, text: str) -> None:
        self.messages = [
            {"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": text},
        ]
        self.n = n

    def turn(self, url: str) -> float:
        body = {"messages": self.messages, "max_tokens": 1, "temperature": 0}
        started = time.perf_counter()
        status, answer = llamabed.http_json("POST", url + "/v1/chat/completions", body, timeout=600)
        seconds = time.perf_counter() - started
        if status != 200:
            raise rig.BenchError(f"chat turn answered HTTP {status}: {str(answer)[:200]}")
        self.messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
        self.messages.append({"role": "user", "content": f"And record {self.n}, turn {len(self.messages) // 2}?"})
        return seconds


def _server(bed: rig.Rig, name: str, *, ram: bool, model: str) -> tuple[llamabed.LlamaServer, Path]:
    slot_dir = bed.slot_dir(name)
    if model == WIDE:
        wide = widekv.model(tokenizer_from=bed.model)
        server = bed.server(slot_dir=slot_dir, n_slots=SLOTS, ctx_size=8192, model=wide, swa_full=False)
    else:
        server = bed.server(slot_dir=slot_dir, n_slots=SLOTS, ctx_size=8192)
    if not ram:
        server.kill()  # the rig starts servers with the default RAM cache: start again without it
        server.extra_args = [*server.extra_args, "--cache-ram", "0"]
        server.start()
        server.wait_healthy(timeout=300)
    return server, slot_dir


def _path(
    bed: rig.Rig, path: str, n: int, *, tokens: int, rounds: int, say: rig.Say, ram: bool = False, model: str = TINY
) -> Run:
    name = f"library-{n}-{'proxy' if path == PROXY else 'direct'}-{int(ram)}-{'wide' if model == WIDE else 'tiny'}"
    server, slot_dir = _server(bed, name, ram=ram, model=model)
    url, side = server.url, None
    if path == PROXY:
        port = net.free_port()
        options = {"--proxy-listen": f"127.0.0.1:{port}"}
        if not ram:
            options["--server-cache-ram-bytes"] = "0"
        side = bed.sidecar(server, slot_dir, **options)
        side.wait_for(lambda: side.get("/readyz")[0] == 200, timeout=60, what="the sidecar ready")
        url = f"http://127.0.0.1:{port}"
    chats = [_Chat(i, llamabed.make_prompt(server.url, tokens, seed=500 + i)) for i in range(n)]
    times: list[list[float]] = []
    for r in range(rounds + 1):
        times.append([chat.turn(url) for chat in chats])
        say(f"  N={n} {path}: round {r}, median turn {rig.median(times[-1]):.3f} s")
    if side is None:
        return Run(n, path, times)
    swaps = side.metric("llama_sidecar_swap_duration_seconds_count")
    seconds = side.metric("llama_sidecar_swap_duration_seconds_sum")
    side.kill()
    return Run(n, path, times, int(swaps), seconds)


def run(
    bed: rig.Rig, sizes: list[int], *, tokens: int, rounds: int, say: rig.Say, ram: bool = False, model: str = TINY
) -> list[Point]:
    points = []
    for n in sizes:
        direct = _path(bed, DIRECT, n, tokens=tokens, rounds=rounds, say=say, ram=ram, model=model)
        proxy = _path(bed, PROXY, n, tokens=tokens, rounds=rounds, say=say, ram=ram, model=model)
        points.append(Point(n, direct, proxy, ram, model))
    return points


def table(points: list[Point], *, tokens: int) -> str:
    return "\n\n".join(
        _table([p for p in points if p.ram is ram and p.model == model], tokens=tokens, ram=ram, model=model)
        for ram in (False, True)
        for model in (TINY, WIDE)
        if any(p.ram is ram and p.model == model for p in points)
    )


def _table(points: list[Point], *, tokens: int, ram: bool, model: str) -> str:
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
    cache = "the server's defaults (RAM prompt cache on)" if ram else "--cache-ram 0"
    head = (
        f"{model}, {SLOTS} slots, {cache}; first messages of ~{tokens:,} tokens; turn = /v1/chat/completions, "
        "max_tokens 1, median over the rounds after the first\n\n"
    )
    return head + rig.table(
        ["conversations", "alone s", "library s", "speed-up", "swaps", "swap s", "prefill saved / swap"], rows
    )


def verdicts(points: list[Point]) -> list[str]:
    lines = []
    for p in points:
        if p.conversations <= SLOTS:
            continue
        figures = (
            f"{p.model}, N={p.conversations}: median turn {rig.median(p.proxy.warm):.3f} s with the library, "
            f"{rig.median(p.direct.warm):.3f} s alone"
        )
        if p.ram:
            price = 1 / p.speedup
            met = price <= DEFAULTS_PRICE
            goal = f"at the server's defaults a turn costs at most {DEFAULTS_PRICE}x llama-server alone"
            lines.append(("MET  " if met else "MISSED ") + f"{goal}: {figures} ({price:.3f}x)")
            continue
        lines.append(
            ("MET  " if p.speedup > 1.0 else "MISSED ")
            + f"library beats llama-server alone: {figures} ({p.speedup:.1f}x)"
        )
    return lines


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


def measure(bed: rig.Rig, *, quick: bool, say: rig.Say, sizes: tuple[int, ...] = (2, 6, 20)) -> tuple[list[Point], str]:
    tokens = 400 if quick else 1000
    rounds = 1 if quick else 2
    points = run(bed, list(sizes), tokens=tokens, rounds=rounds, say=say)
    at_defaults = [n for n in sizes if n > SLOTS][: 1 if quick else None]
    for model in (TINY, WIDE):
        points += run(bed, at_defaults, tokens=tokens, rounds=rounds, say=say, ram=True, model=model)
    return points, table(points, tokens=tokens) + "\n\n" + "\n".join(verdicts(points))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.library", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter prompts, one warm round")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "out", help="PNG, JSON and logs go here")
    parser.add_argument("--threads", type=int, default=2, help="llama-server -t (default 2)")
    parser.add_argument("--conversations", default="2,6,20", help="numbers of conversations to run (default 2,6,20)")
    ns = parser.parse_args(argv)
    sizes = tuple(int(n) for n in ns.conversations.split(","))
    bed = rig.Rig(log_dir=ns.out / f"logs-library-{time.strftime('%Y%m%d-%H%M%S')}", threads=ns.threads)
    try:
        before = rig.busy()
        points, body = measure(
            bed, quick=ns.quick, say=lambda text: print(text, file=sys.stderr, flush=True), sizes=sizes
        )
        print(f"## Conversation library\n({before} at start, {rig.busy()} at end)\n")
        print(body)
    finally:
        bed.close()
    raw: list[dict[str, Any]] = [dataclasses.asdict(p) for p in points]
    (ns.out / "library.json").write_text(json.dumps(raw, indent=2))
    plot(
        [p for p in points if not p.ram],
        ns.out / "library.png",
        f"TTFT per turn, N conversations on {SLOTS} slots, --cache-ram 0",
    )
    print(f"wrote {ns.out / 'library.png'}, library.json")
    return 1 if any(line.startswith("MISSED") for line in verdicts(points)) else 0


if __name__ == "__main__":
    sys.exit(main())
