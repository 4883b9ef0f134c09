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
of ``python -m bench``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import matplotlib as mpl

mpl.use("Agg")

import matplotlib.pyplot as plt
from matplotlib import ticker

from bench import REPO_ROOT, rig
from bench.beds import llamabed, net, sidecarbed, widekv
from sidecar.core import config

SLOTS = 2
DIRECT, PROXY = "llama-server alone", "with the library"
DEFAULTS_PRICE = 1.03
"""Most a turn through the proxy may take, over llama-server alone, both at their defaults (RAM cache on)."""
DEFAULTS_TURNS = 60
"""Timed turns per path at the defaults, quick or not (in rounds of N, at least 3 of 20): a turn there is 0.1-0.3 s,
and the 3% judged is 3-9 ms, about what the median of 20 turns moves from run to run (two runs of llama-server
alone side by side differ by 1-3%; 18 turns at N=6 put it 6% off)."""
CACHED_GOAL = 0.99
"""Share of its previous prompt every conversation's turn after the kill -9 must reuse, through the proxy."""
TINY, WIDE = "gemma3-270m", "8B-class KV"
TINY_SWA = "gemma3-270m, no --swa-full"
"""The bed's model at llama-server's own defaults: its windowed layers keep only the window."""
"""The bed's model, and the random-weight one whose KV is 128 KiB per token (``tests.support.widekv``)."""
MODELS = {"tiny": TINY, "wide": WIDE, "swa": TINY_SWA}
"""``--models`` names."""
WHOLE, BLOCKS = "whole files", "block store"
"""The sidecar's ways at the defaults: whole slot files in ``--slot-dir``, or ``--store-dir`` (slot dir on tmpfs)."""
STAGING = Path("/dev/shm")
"""Where the block store's slot dirs go (``--staging``): a tmpfs."""


@dataclasses.dataclass(frozen=True, slots=True)
class Run:
    conversations: int
    path: str
    rounds: list[list[float]]
    """Seconds per turn, one list per round (round 0: every conversation's first turn)."""
    swaps: int = 0
    swap_seconds: float = 0.0
    way: str = ""
    """Through the proxy: the sidecar's way, :data:`WHOLE` or :data:`BLOCKS`."""
    after_kill: list[float] = dataclasses.field(default_factory=list)
    """At the defaults, per conversation: the share of its previous prompt its turn after the kill -9 reused."""
    after_kill_seconds: list[float] = dataclasses.field(default_factory=list)
    """That turn's time per conversation."""
    after_kill_prefill: list[float] = dataclasses.field(default_factory=list)
    """That turn's prefill of what it did not reuse, in seconds (``timings.prompt_ms``), per conversation."""
    bound: float = config.MAX_UNSAVED_SECONDS
    """The sidecar's ``--max-unsaved-seconds``: the re-prefill a crash may cost a conversation."""
    figures: dict[str, float] = dataclasses.field(default_factory=dict)
    """Through the proxy at the defaults: the sidecar's counters that say what the turns cost (:data:`FIGURES`)."""
    cpu: float = 0.0
    """Through the proxy: the sidecar's CPU seconds over the timed rounds (it shares the machine's cores with
    every path's llama-server: its polls and saves run while a turn of either path may)."""

    @property
    def warm(self) -> list[float]:
        return [t for r in self.rounds[1:] for t in r]

    @property
    def warm_after_kill(self) -> int:
        """Conversations whose turn after the kill -9 reused at least :data:`CACHED_GOAL` of their previous prompt."""
        return sum(share >= CACHED_GOAL for share in self.after_kill)

    @property
    def within_bound_after_kill(self) -> int:
        """Conversations whose turn after the kill -9 reused :data:`CACHED_GOAL`, or re-prefilled within ``bound``."""
        return sum(
            share >= CACHED_GOAL or seconds <= self.bound
            for share, seconds in zip(self.after_kill, self.after_kill_prefill, strict=True)
        )


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
    def paired_price(self) -> float:
        """The median over the timed turns of each turn through the proxy ÷ the same conversation's same turn on
        llama-server alone, the two taken one right after the other (:func:`_rounds`): the price judged at the
        defaults. A conversation's prompt grows every round, so the turns of one path spread over about 2x (0.16
        to 0.32 s at 8B-class KV, N=6) with gaps between them, and the ratio of the two medians moved by 5% when
        every pair differed by about 1 ms (measured: a median of the paired differences of 1.0 ms, the ratio of
        medians 1.051x)."""
        return rig.median([p / d for p, d in zip(self.proxy.warm, self.direct.warm, strict=True)])

    @property
    def swap_mean(self) -> float:
        return self.proxy.swap_seconds / self.proxy.swaps if self.proxy.swaps else float("nan")

    @property
    def label(self) -> str:
        return f"{self.model}" + (f", {self.proxy.way}" if self.proxy.way else "") + f", N={self.conversations}"


class _Chat:
    def __init__(self, n: int, text: str) -> None:
        self.messages = [
            {"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": text},
        ]
        self.n = n
        self.prompt = 0
        """Prompt tokens of the last turn (``usage.prompt_tokens``)."""
        self.cached = 0
        """Of them, reused (``usage.prompt_tokens_details.cached_tokens``; ``timings.cache_n`` says the same)."""
        self.prefill = 0.0
        """Seconds the server spent on the last turn's prompt tokens it did not reuse (``timings.prompt_ms``)."""

    def turn(self, url: str) -> float:
        body = {"messages": self.messages, "max_tokens": 1, "temperature": 0}
        started = time.perf_counter()
        status, answer = llamabed.http_json("POST", url + "/v1/chat/completions", body, timeout=600)
        seconds = time.perf_counter() - started
        if status != 200:
            raise rig.BenchError(f"chat turn answered HTTP {status}: {str(answer)[:200]}")
        self.prompt = int(answer["usage"]["prompt_tokens"])
        self.cached = int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
        self.prefill = float(answer["timings"]["prompt_ms"]) / 1000
        self.messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
        self.messages.append({"role": "user", "content": f"And record {self.n}, turn {len(self.messages) // 2}?"})
        return seconds


FIGURES: tuple[tuple[str, str, dict[str, str]], ...] = (
    ("in library", "llama_sidecar_library_conversations", {}),
    ("counted in RAM", "llama_sidecar_library_ram_conversations", {}),
    ("left unsaved", "llama_sidecar_library_left_unsaved_reprefill_seconds_count", {}),
    ("unsaved s", "llama_sidecar_library_left_unsaved_reprefill_seconds_sum", {}),
    ("saves", "llama_sidecar_snapshot_duration_seconds_count", {}),
    ("save s", "llama_sidecar_snapshot_duration_seconds_sum", {}),
    ("from slot", "llama_sidecar_conversation_requests_total", {"source": "slot"}),
    ("from ram", "llama_sidecar_conversation_requests_total", {"source": "ram"}),
    ("from library", "llama_sidecar_conversation_requests_total", {"source": "library"}),
    ("cold", "llama_sidecar_conversation_requests_total", {"source": "cold"}),
    ("restores ok", "llama_sidecar_restores_total", {"result": "ok"}),
    ("restore s", "llama_sidecar_restore_duration_seconds_sum", {}),
)
"""The sidecar's figures read through the proxy at the defaults: before the kill -9 (``name``) and at the end
(``name + " end"``), so what the timed rounds cost and what the kill round cost are apart."""


def _figures(side: sidecarbed.SidecarProcess, suffix: str = "") -> dict[str, float]:
    return {name + suffix: side.metric(metric, **labels) for name, metric, labels in FIGURES}


def _server(bed: rig.Rig, slot_dir: Path, *, ram: bool, model: str) -> llamabed.LlamaServer:
    if model == WIDE:
        wide = widekv.model(tokenizer_from=bed.model)
        server = bed.server(slot_dir=slot_dir, n_slots=SLOTS, ctx_size=8192, model=wide, swa_full=False, alone=False)
    else:
        server = bed.server(slot_dir=slot_dir, n_slots=SLOTS, ctx_size=8192, swa_full=model != TINY_SWA, alone=False)
    if not ram:
        server.kill()  # the rig starts servers with the default RAM cache: start again without it
        server.extra_args = [*server.extra_args, "--cache-ram", "0"]
        server.start()
        server.wait_healthy(timeout=300)
    return server


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """What one path of one point runs."""

    n: int
    tokens: int
    rounds: int
    ram: bool = False
    model: str = TINY
    way: str = ""
    """Through the proxy: :data:`WHOLE` or :data:`BLOCKS`; empty for llama-server alone."""
    staging: Path = STAGING
    max_unsaved: str = ""
    """``--max-unsaved-seconds`` for the sidecar; empty: its default."""


@dataclasses.dataclass(slots=True)
class _Open:
    """One path up: its llama-server (and sidecar in front), its conversations, and their turns so far."""

    plan: Plan
    slot_dir: Path
    staged: bool = False
    """The slot dir is under ``plan.staging`` (removed at the end)."""
    server: llamabed.LlamaServer | None = None
    side: sidecarbed.SidecarProcess | None = None
    url: str = ""
    chats: list[_Chat] = dataclasses.field(default_factory=list)
    times: list[list[float]] = dataclasses.field(default_factory=list)
    cpu: float = 0.0
    """The sidecar's CPU seconds over the timed rounds (after round 0)."""

    @property
    def label(self) -> str:
        return f"{PROXY if self.plan.way else DIRECT} {self.plan.way}".rstrip()


TAGS = {"": "alone", WHOLE: "whole", BLOCKS: "block"}
"""Each path's name in its slot dir's, all of one length, so that the two llama-servers of a pair run with
command lines of one length. Measured (the tiny model, N=20, whole files): named ``direct`` and ``whole``, one
byte apart, the proxy's llama-server took 1.4-3.1 ms (1.5-3.5%) more of its own prompt time per turn than the
one alone in 7 runs of 7, and the pair said 1.030-1.051x; named ``alone`` and ``whole``, -1.6 to +0.5 ms in 3 runs
of 3, and 1.007-1.024x. An extra environment variable of any length moved it as well (1.005-1.019x in 3 runs). A
process's layout in memory follows the size of its command line and environment, and llama-server's speed here
follows its layout: the pair measured that, not the sidecar."""


def slot_name(plan: Plan) -> str:
    """The name of a path's slot dir: of one length for every path of a pair (:data:`TAGS`)."""
    model = {WIDE: "wide", TINY_SWA: "tswa"}.get(plan.model, "tiny")
    return f"library-{plan.n}-{TAGS[plan.way]}-{int(plan.ram)}-{model}"


def _open(bed: rig.Rig, plan: Plan, *, staged: bool = False) -> _Open:
    """Start a path's llama-server (a fresh slot dir), and the sidecar's proxy in front of it for a way.

    ``staged``: the slot dir under ``plan.staging``, as the block store's (llama-server alone beside it takes
    one there too, for a command line of the same length)."""
    name = slot_name(plan)
    slot_dir = bed.slot_dir(name)
    opened = _Open(plan, slot_dir, staged)
    store_dir = slot_dir
    if staged:  # the server's saves land in RAM; the block store on disk keeps what they hold
        opened.slot_dir = plan.staging / f"llama-kv-bench-{os.getpid()}-{name}"
        shutil.rmtree(opened.slot_dir, ignore_errors=True)
        opened.slot_dir.mkdir(parents=True)
    server = opened.server = _server(bed, opened.slot_dir, ram=plan.ram, model=plan.model)
    opened.url = server.url
    if plan.way:
        port = net.free_port()
        options = {"--proxy-listen": f"127.0.0.1:{port}"}
        if not plan.ram:
            options["--server-cache-ram-bytes"] = "0"
        if plan.way == BLOCKS:
            options["--store-dir"] = str(store_dir)
        else:  # whole files even in a tmpfs slot dir (where the block store is the default)
            options["--whole-files"] = ""
        if plan.max_unsaved:
            options["--max-unsaved-seconds"] = plan.max_unsaved
        side = opened.side = bed.sidecar(server, opened.slot_dir, **options)
        side.wait_for(lambda: side.get("/readyz")[0] == 200, timeout=120, what="the sidecar ready")
        opened.url = f"http://127.0.0.1:{port}"
    opened.chats = [_Chat(i, llamabed.make_prompt(server.url, plan.tokens, seed=500 + i)) for i in range(plan.n)]
    return opened


def _finish(opened: _Open, say: rig.Say) -> Run:
    """The path's run, with the kill round at the defaults; its processes stopped."""
    plan, side, server = opened.plan, opened.side, opened.server
    assert server is not None
    path = PROXY if plan.way else DIRECT
    if side is None:
        run = Run(plan.n, path, opened.times)
    else:
        swaps = side.metric("llama_sidecar_swap_duration_seconds_count")
        seconds = side.metric("llama_sidecar_swap_duration_seconds_sum")
        bound = float(plan.max_unsaved) if plan.max_unsaved else config.MAX_UNSAVED_SECONDS
        run = Run(plan.n, path, opened.times, int(swaps), seconds, plan.way, bound=bound, cpu=opened.cpu)
    if plan.ram:
        run = _after_kill(run, server, side, opened.chats, opened.url, say)
    if side is not None:
        side.kill()
    server.kill()
    return run


def _close(opened: _Open) -> None:
    if opened.side is not None:
        opened.side.kill()
    if opened.server is not None:
        opened.server.kill()
    if opened.staged:
        shutil.rmtree(opened.slot_dir, ignore_errors=True)


def _rounds(paths: list[_Open], say: rig.Say) -> None:
    """Every round, each conversation's turn on every path, one after the other: side by side, so that the
    machine's load (which moves a turn by more than 3% from one minute to the next) weighs on each alike. The
    path that goes first turns over from one conversation to the next."""
    plan = paths[0].plan
    for r in range(plan.rounds + 1):
        if r == 1:
            for opened in paths:
                opened.cpu = -rig.cpu_seconds(opened.side.proc.pid) if opened.side and opened.side.proc else 0.0
        for opened in paths:
            opened.times.append([])
        for i in range(plan.n):
            first = (i + r) % len(paths)
            for opened in paths[first:] + paths[:first]:
                opened.times[-1].append(opened.chats[i].turn(opened.url))
        for opened in paths:
            say(f"  N={plan.n} {opened.label}: round {r}, median turn {rig.median(opened.times[-1]):.3f} s")
    for opened in paths:
        if opened.side is not None and opened.side.proc is not None:
            opened.cpu += rig.cpu_seconds(opened.side.proc.pid)


def _side_by_side(bed: rig.Rig, plans: list[Plan], say: rig.Say) -> list[Run]:
    """The runs of ``plans`` (the same conversations on each path), their turns taken side by side."""
    paths: list[_Open] = []
    staged = any(plan.way == BLOCKS for plan in plans)
    try:
        for plan in plans:
            paths.append(_open(bed, plan, staged=staged))
        _rounds(paths, say)
        return [_finish(opened, say) for opened in paths]
    finally:
        for opened in paths:
            _close(opened)


def _after_kill(
    run: Run,
    server: llamabed.LlamaServer,
    side: sidecarbed.SidecarProcess | None,
    chats: list[_Chat],
    url: str,
    say: rig.Say,
) -> Run:
    """``kill -9`` llama-server, start it the same way, then one more turn of every conversation."""
    figures: dict[str, float] = {}
    if side is not None:
        side.wait_for(  # the slots' last turns saved once idle, as a host's crash finds them between turns
            lambda: all(side.metric("llama_sidecar_slot_unsaved_since_timestamp_seconds", slot=str(s)) == 0
                        for s in range(SLOTS)),
            timeout=120,
            what="every slot's changes saved",
        )  # fmt: skip
        figures = _figures(side)
    server.restart(timeout=300)  # kill -9, started again the same way
    if side is not None:
        side.wait_for(lambda: side.get("/readyz")[0] == 200, timeout=300, what="the sidecar ready after the kill")
    prompts = [chat.prompt for chat in chats]
    seconds = [chat.turn(url) for chat in chats]
    shares = [chat.cached / prompt for chat, prompt in zip(chats, prompts, strict=True)]
    prefill = [chat.prefill for chat in chats]
    say(f"  N={run.conversations} {run.path} {run.way}: after the kill -9, reused "
        + ", ".join(f"{x:.0%}" for x in shares))  # fmt: skip
    if side is not None:
        figures |= _figures(side, " end")
    return dataclasses.replace(
        run, after_kill=shares, after_kill_seconds=seconds, after_kill_prefill=prefill, figures=figures
    )


def run(bed: rig.Rig, sizes: list[int], *, tokens: int, rounds: int, say: rig.Say, ram: bool = False,
        model: str = TINY, ways: tuple[str, ...] = (WHOLE,), staging: Path = STAGING,
        max_unsaved: str = "") -> list[Point]:  # fmt: skip
    """Per N and each of ``ways``: llama-server alone and the proxy, side by side.

    A pair at a time, not every way at once: with three paths side by side each slot would sit idle three
    turns' time between its own, long enough for idle saves no single path would make."""
    points = []
    for n in sizes:
        base = Plan(n, tokens, rounds, ram, model, staging=staging, max_unsaved=max_unsaved)
        for way in ways:
            direct, proxy = _side_by_side(bed, [base, dataclasses.replace(base, way=way)], say)
            points.append(Point(n, direct, proxy, ram, model))
    return points


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
