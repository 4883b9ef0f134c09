"""The conversation library's paths: llama-server alone or behind the sidecar's proxy, turns taken side by side.

A path is one llama-server (and a sidecar in front of it for a way), its conversations, and their turns so far.
:func:`run` takes a pair of paths (llama-server alone and the proxy) per N, their turns side by side, then at the
defaults a ``kill -9`` and one more turn each. :mod:`bench.library` prints and judges what it returns.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from pathlib import Path

from bench import rig
from bench.beds import llamabed, net, sidecarbed, widekv
from sidecar.core import config

SLOTS = 2
DIRECT, PROXY = "llama-server alone", "with the library"
CACHED_GOAL = 0.99
"""Share of its previous prompt every conversation's turn after the kill -9 must reuse, through the proxy."""
TINY, WIDE = "gemma3-270m", "8B-class KV"
TINY_SWA = "gemma3-270m, no --swa-full"
"""The bed's model at llama-server's own defaults: its windowed layers keep only the window."""
"""The bed's model, and the random-weight one whose KV is 128 KiB per token (``tests.support.widekv``)."""
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
