"""The proxy's price on every turn: through the proxy against straight to llama-server, per API, in one run.

One llama-server at its defaults but for the test bed's layout (4 slots of
8,192 tokens, ``-c 32768``, ``--swa-full``; the RAM prompt cache on) and one
sidecar with the proxy on, its own defaults. Measured side by side, each
way on its own keep-alive connection, alternating which goes first from one
timed turn of a kind to the next (so streamed and non-streamed turns each go
first half the time):

* **Warm turns**, per API the proxy routes (Chat Completions, Anthropic
  Messages, Responses, ``/completion``): two conversations of the same
  length (a system prompt, a tool and a history of ``tokens``, 2K-8K: long
  enough to be routed), one sent straight to llama-server, one through the
  proxy, each turn adding an assistant answer and a new user line, so every
  turn is a conversation's next one (the server reuses its prefix and
  prefills the new line; through the proxy the library routes it: template,
  tokens, slot). 30 non-streamed turns are timed to the answer's end
  (``max_tokens`` 1) and :data:`STREAMED` streamed ones (120) to the first
  byte of the answer's body, spread among each other (:func:`schedule`).
  Every :data:`SEGMENT` turns the conversation goes back to its history with
  a new line (its first two turns then are not timed), so that it stays
  inside its slot.
* **The same work**: after each turn, llama-server's compute for it (its
  prompt and generation seconds, its ``/metrics``) and the prompt tokens it
  processed. Where the proxied turn made the server process no more than the
  direct one (:data:`SAME_WORK_TOKENS`), it is counted with the direct
  turn's compute in place of its own (:func:`_swapped`): the server's swing
  from turn to turn is taken out, what the proxy adds stays. The goals are
  judged on these; the figures as measured are printed beside them.
* **A spacer** (:class:`Spacer`): a one-token ``/completion`` on a third
  slot, straight to the server, after every timed turn, so that neither way
  waits for the server's work after the other's turn.
* **The proxy's CPU per request**: the sidecar's CPU time (all threads,
  ``schedstat``) over the proxied turns, its idle polling subtracted.
* **Non-routed requests** (``bench.proxy.NON_ROUTED``: ``/tokenize``, a
  ``/completion`` with its own ``id_slot``): the time the proxy adds at p50.
* **A turn after a kill -9**: a proxied chat's next turn sent the moment the
  restarted server answers ``/health`` (the sidecar's detection, restore and
  the gate on its path), against the same turn with no crash (both reuse the
  same prefix: each turn's new line starts with a word of its own), sent
  once the last crash's restore round has ended and a spacer has had the
  server copy the slots it restored into its RAM prompt cache.
  :data:`CRASHES` crashes (3 with ``--quick``).

Goals (MISSED and exit status 1 when missed): a warm turn at most
:data:`TURN_GOAL` x direct at p50, the first streamed byte at most
:data:`FIRST_BYTE_GOAL_MS` ms later, a non-routed request at most
:data:`NON_ROUTED_GOAL_MS` ms later at p50, and the turn after a crash at most
:data:`CRASH_GOAL` x the turn without. Each is taken over pairs: a turn (or
request) straight to the server and the same turn through the proxy, sent
one right after the other, give one ratio or difference; the median of the
pairs where the direct one went first and that of the pairs where the proxy
went first are averaged (see :func:`_paired`); warm turns and first bytes
with the same work's compute (above). With ``--quick``, a goal whose figure
varies between rounds (the turns cut in :data:`ROUNDS`; each crash) by more
than its margin to the bar gets NO VERDICT; the full run decides.

Run alone with ``python -m bench.price [--quick]``, or as the ``price``
section of ``python -m bench``.
"""

from __future__ import annotations

import copy
import dataclasses
import http.client
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from bench import agents, rig, section
from bench import proxy as proxy_mod
from bench.beds import llamabed, net, sidecarbed, wait

DIRECT, PROXY = proxy_mod.DIRECT, proxy_mod.PROXY
TURN_GOAL = 1.03
"""A warm turn through the proxy over the direct one (p50s)."""
FIRST_BYTE_GOAL_MS = 3.0
"""Milliseconds the proxy may add to the first streamed byte (p50s)."""
NON_ROUTED_GOAL_MS = 1.0
"""Milliseconds the proxy may add to a request it does not route (p50s)."""
CRASH_GOAL = 1.2
"""The turn after a kill -9 (from /health ok) over the same turn with no crash (medians)."""
ROUNDS = 2
"""Rounds the turns are cut into, for the spread that decides whether a quick run can give a verdict."""
SAME_WORK_TOKENS = 16
"""Prompt tokens the server may process more for the proxied turn than for the direct one and still count as the
same work (see :func:`_swapped`)."""
STREAMED = 120
"""Streamed turns timed per API and way in a full run (30 non-streamed): one streamed turn's time outside the
server's compute moves by 5-8 ms (interquartile range of the pairs' differences) from turn to turn, so 30 pairs
left the first-byte figure's median about 1.5 ms from where the next run put it, half the goal."""
CRASHES = 9
"""Crashes in a full run (each against the turn with no crash right before it)."""
SLOTS, CTX = 4, 8192
APIS = ("chat completions", "anthropic messages", "responses", "/completion")
WORDS = ("Amber", "Basil", "Cedar", "Delta", "Ember", "Flint", "Garnet", "Harbor", "Indigo", "Juniper", "Kestrel")


def _line(n: int) -> str:
    """A turn's new user line: its first word differs from every other turn's, so no turn reuses another's."""
    return f"{WORDS[n % len(WORDS)]} {n}: in one word, which of these words came first?"


class Talk:
    """One conversation of one API, grown by a turn at a time."""

    def __init__(self, api: str, history: str) -> None:
        self.api = api
        self.turns: list[str] = [history]
        """User lines; an assistant "ok" between two of them."""

    def grow(self, n: int) -> None:
        self.turns.append(_line(n))

    def again(self, n: int) -> None:
        """Back to the history and a new line: the next turn starts a new conversation that reuses the history."""
        self.turns[1:] = [f"{_line(n)} Once more."]

    def request(self, *, stream: bool, line: str | None = None) -> tuple[str, dict[str, Any]]:
        """(path, body) of the next turn (the conversation so far, plus ``line`` if given)."""
        turns = self.turns + ([line] if line is not None else [])
        if self.api == "/completion":
            prompt = agents.SYSTEM + "\n\n" + "\nA: ok\n\nQ: ".join(turns) + "\nA:"
            return "/completion", {
                "prompt": prompt, "n_predict": 1, "temperature": 0, "cache_prompt": True, "stream": stream,
            }  # fmt: skip
        path, body = copy.deepcopy(agents.bodies(turns[0])[self.api])
        body["stream"] = stream
        if self.api == "responses":
            body["input"] += _alternate(turns[1:], _responses_item)
        else:  # Chat Completions and Anthropic Messages: the same message shape for plain text
            body["messages"] += _alternate(turns[1:], lambda role, text: {"role": role, "content": text})
        return path, body


def _responses_item(role: str, text: str) -> dict[str, Any]:
    kind = "output_text" if role == "assistant" else "input_text"
    return {"type": "message", "role": role, "content": [{"type": kind, "text": text}]}


def _alternate(lines: list[str], make: Any) -> list[dict[str, Any]]:
    out = []
    for text in lines:
        out += [make("assistant", "ok"), make("user", text)]
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class Api:
    name: str
    turn_ms: dict[str, list[float]]
    """Non-streamed warm turns, to the answer's end, per way."""
    first_ms: dict[str, list[float]]
    """Streamed warm turns, to the first byte of the answer's body, per way."""
    cpu_us: float
    """The sidecar's CPU time per proxied turn, its idle polling subtracted (µs)."""
    outside_ms: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    """``first_ms`` less llama-server's own compute for the turn (its prompt and generation seconds)."""
    compute_ms: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    """llama-server's own compute for each non-streamed turn of ``turn_ms`` (its prompt and generation seconds)."""
    turn_tokens: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    """Prompt tokens llama-server processed (not reused) for each turn of ``turn_ms``."""
    first_tokens: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    """Prompt tokens llama-server processed (not reused) for each streamed turn of ``first_ms``."""

    def ratio(self, part: slice = slice(None)) -> float:
        """Through the proxy over direct, per turn, as measured (see :func:`_paired`)."""
        return _paired(self.turn_ms, part, _ratio)

    def added(self, part: slice = slice(None)) -> float:
        """Through the proxy minus direct, per streamed turn, as measured (ms; see :func:`_paired`)."""
        return _paired(self.first_ms, part, _difference)

    def turn_ratio(self, part: slice = slice(None)) -> float:
        """:meth:`ratio` with each proxied turn of the same work given the direct turn's compute (the goal's figure).

        See :func:`_swapped`; as measured for a ``results.json`` from before the server's compute was read.
        """
        if not self.compute_ms:
            return self.ratio(part)
        swapped = _swapped(self.turn_ms, self.compute_ms, self.turn_tokens)
        return _paired({DIRECT: self.turn_ms[DIRECT], PROXY: swapped}, part, _ratio)

    def first_added(self, part: slice = slice(None)) -> float:
        """:meth:`added` with each proxied turn of the same work given the direct turn's compute (ms; the goal's)."""
        if not self.first_tokens:
            return self.added(part)
        compute = {
            way: [f - o for f, o in zip(self.first_ms[way], self.outside_ms[way], strict=True)]
            for way in (DIRECT, PROXY)
        }
        swapped = _swapped(self.first_ms, compute, self.first_tokens)
        return _paired({DIRECT: self.first_ms[DIRECT], PROXY: swapped}, part, _difference)

    def different_work(self) -> int:
        """Pairs, of both kinds, where the server processed more for the proxied turn (counted as measured)."""
        return sum(_more_work(tokens) for tokens in (self.turn_tokens, self.first_tokens) if tokens)

    def outside(self, part: slice = slice(None)) -> float:
        """:meth:`added` with llama-server's own compute for each turn taken out, both ways (ms; NaN if not read).

        The compute of one streamed turn varies by tens of milliseconds on a
        loaded 2-core machine, the same way both ways, and buries a few
        milliseconds of the proxy's; what is left is the rest of the turn's
        path (HTTP, template, tokenizing, the slot cache, the proxy). A
        diagnostic, not the goal: it leaves out whatever the proxy would make
        the server's compute cost (its CPU beside the server's threads).
        """
        return _paired(self.outside_ms, part, _difference) if self.outside_ms else float("nan")


def _paired(ms: dict[str, list[float]], part: slice, of: Callable[[float, float], float]) -> float:
    """``of(direct, proxy)`` for each turn in ``part`` (the two ways' same turn, sent one right after the
    other), its median over the turns where each way went first, and the mean of those two.

    Paired, not two medians taken apart: the server's own time drifts over a run (the machine, the
    growing prompts) by more than the proxy adds. And per order: the way sent second waits for the
    server's work after the first (with the RAM prompt cache on, its task first copies the slot the
    other just changed: about 17 ms on these histories), so the pairs of each order sit about that far
    on either side of the proxy's own price, and one median over both orders lands anywhere between
    the two; the order changes every pair, so each half holds one order.
    """
    by_order: tuple[list[float], list[float]] = ([], [])
    for i in range(len(ms[DIRECT]))[part]:
        by_order[i % 2].append(of(ms[DIRECT][i], ms[PROXY][i]))
    medians = [rig.median(values) for values in by_order if values]
    return sum(medians) / len(medians)


def _swapped(ms: dict[str, list[float]], compute: dict[str, list[float]], tokens: dict[str, list[int]]) -> list[float]:
    """The proxied turns' times, each with the direct turn's server compute in place of its own where the server
    did the same work for both (it processed at most :data:`SAME_WORK_TOKENS` more prompt tokens for the proxy's).

    llama-server's compute for one turn swings by tens of milliseconds on a loaded 2-core machine, each turn
    on its own, and buries the few milliseconds the proxy adds; given the same work, that swing is the
    server's, not the proxy's. What is left to compare is the rest of the turn's path: HTTP, the library's
    template, tokens and slot, the relay. A proxied turn that made the server process more (a missed route,
    a slot it had to fill) keeps its own compute: that cost is the proxy's. Not taken out: anything the
    proxy's CPU costs the server's threads while they compute (the proxy's CPU per request is beside it).
    """
    out = []
    for i, proxied in enumerate(ms[PROXY]):
        same = tokens[PROXY][i] - tokens[DIRECT][i] <= SAME_WORK_TOKENS
        out.append(proxied - compute[PROXY][i] + compute[DIRECT][i] if same else proxied)
    return out


def _more_work(tokens: dict[str, list[int]]) -> int:
    return sum(p - d > SAME_WORK_TOKENS for d, p in zip(tokens[DIRECT], tokens[PROXY], strict=True))


def _ratio(direct: float, proxy: float) -> float:
    return proxy / direct


def _difference(direct: float, proxy: float) -> float:
    return proxy - direct


@dataclasses.dataclass(frozen=True, slots=True)
class Crash:
    tokens: int
    crashed_ms: list[float]
    """The turn sent the moment the restarted server answered /health, to its answer's end."""
    calm_ms: list[float]
    """The same turn with no crash before it."""
    cache_n: list[int]
    """Prompt tokens each crashed turn reused (the server's ``timings.cache_n``)."""
    calm_cache_n: list[int]

    @property
    def ratios(self) -> list[float]:
        return [c / k for c, k in zip(self.crashed_ms, self.calm_ms, strict=True)]

    @property
    def ratio(self) -> float:
        """The median of the crashes' ratios (each crash against the calm turn right before it)."""
        return rig.median(self.ratios)


@dataclasses.dataclass(frozen=True, slots=True)
class Result:
    tokens: int
    apis: list[Api]
    non_routed: list[proxy_mod.Latency]
    crash: Crash
    quick: bool


def _added(lat: proxy_mod.Latency, part: slice = slice(None)) -> float:
    """What the proxy added to a non-routed request, per pair (ms; see :func:`_paired`)."""
    return _paired({DIRECT: lat.direct_ms, PROXY: lat.proxy_ms}, part, _difference)


def _parts(n: int) -> list[slice]:
    size = max(1, n // ROUNDS)
    return [slice(i * size, (i + 1) * size if i < ROUNDS - 1 else None) for i in range(ROUNDS)]


class Compute:
    """llama-server's own work since the last reading, from ``/metrics``: its prompt and generation seconds, and
    the prompt tokens it processed."""

    COUNTERS = ("llamacpp:prompt_seconds_total", "llamacpp:tokens_predicted_seconds_total")
    TOKENS = "llamacpp:prompt_tokens_total"

    def __init__(self, port: int) -> None:
        self._port = port
        self._http = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        self._last = self._read()

    def since(self) -> tuple[float, int]:
        """(milliseconds of compute, prompt tokens processed) since the last call (or since this was made)."""
        now = self._read()
        spent = ((now[0] - self._last[0]) * 1000, round(now[1] - self._last[1]))
        self._last = now
        return spent

    def _read(self) -> tuple[float, float]:
        try:
            return self._get()
        except (http.client.HTTPException, OSError):  # a kept-alive connection the server closed: once more
            self._http.close()
            self._http = http.client.HTTPConnection("127.0.0.1", self._port, timeout=60)
            return self._get()

    def _get(self) -> tuple[float, float]:
        self._http.request("GET", "/metrics")
        resp = self._http.getresponse()
        text = resp.read().decode()
        if resp.status != 200:
            raise rig.BenchError(f"/metrics answered HTTP {resp.status}: {text[:200]!r}")
        wanted = (*self.COUNTERS, self.TOKENS)
        values = dict(line.split(" ", 1) for line in text.splitlines() if line.startswith(wanted))
        missing = [name for name in wanted if name not in values]
        if missing:
            raise rig.BenchError(f"llama-server's /metrics has no {', '.join(missing)}")
        return sum(float(values[name]) for name in self.COUNTERS), float(values[self.TOKENS])

    def close(self) -> None:
        self._http.close()


class Spacer:
    """A one-token ``/completion`` on a slot neither conversation holds, sent straight to llama-server after each
    timed turn, so that no timed turn waits for the server's work after the one before it.

    With the RAM prompt cache on, the server's next task after a turn first does that turn's after-work (about
    17 ms on these histories, see :func:`_paired`): without the spacer it falls on whichever way goes next.
    The spacer's slot is one the conversations are not on: after each conversation's first turn, the slot
    ``/slots`` shows with the newest task is taken as that conversation's (:meth:`note`).
    """

    def __init__(self, port: int, slots: int) -> None:
        self._conn = proxy_mod.Conn(port)
        self._port = port
        self._free = list(range(slots))

    def note(self) -> None:
        """The conversation that just had its first turn holds the slot with the newest task: not the spacer's."""
        conn = http.client.HTTPConnection("127.0.0.1", self._port, timeout=60)
        try:
            conn.request("GET", "/slots")
            resp = conn.getresponse()
            body = resp.read()
        finally:
            conn.close()
        if resp.status != 200:
            raise rig.BenchError(f"/slots answered HTTP {resp.status}: {body[:200]!r}")
        tasks = [(s["id_task"], s["id"]) for s in json.loads(body) if s.get("id_task") is not None]
        if not tasks:
            raise rig.BenchError("/slots shows no slot with a task after a conversation's first turn")
        newest = max(tasks)[1]
        if newest in self._free:
            self._free.remove(newest)

    def run(self) -> None:
        if len(self._free) == 0:
            raise rig.BenchError("every slot holds a timed conversation: no slot is left for the spacer")
        body = {"prompt": "Spacer.", "n_predict": 1, "id_slot": self._free[-1], "cache_prompt": True}
        self._conn.timed("/completion", body)

    def close(self) -> None:
        self._conn.close()


SEGMENT = 40
"""Turns a conversation grows by before it goes back to its history (at about 45 tokens a chat turn, a 4,000-token
history stays inside a slot's 8,192); the first two of each segment are not timed."""


def schedule(timed: int, streamed: int) -> list[tuple[bool, bool, bool]]:
    """(streamed, timed, back to the history first) of each turn of one conversation, in order.

    ``timed`` non-streamed and ``streamed`` streamed turns are timed, the non-streamed ones spread evenly among
    the streamed ones. Each segment of :data:`SEGMENT` turns starts with two turns that are not timed: the
    first goes back to the conversation's history with a new line (a new conversation on the server's side
    that reuses the history: routed by its token ids, not as a next turn; the very first one is cold), the
    second is that conversation's first next turn.
    """
    total = timed + streamed
    kinds = [(i + 1) * timed // total > i * timed // total for i in range(total)]  # True: non-streamed
    out: list[tuple[bool, bool, bool]] = []
    for n, plain in enumerate(kinds):
        if n % (SEGMENT - 2) == 0:
            out += [(False, False, n > 0), (True, False, False)]
        out.append((not plain, True, False))
    return out


def _turns(
    api: str,
    history: tuple[str, str],
    ports: dict[str, int],
    pid: int,
    *,
    reps: int,
    streamed: int,
    idle: float,
    say: rig.Say,
) -> Api:
    talks = {DIRECT: Talk(api, history[0]), PROXY: Talk(api, history[1])}
    conns = {way: proxy_mod.Conn(port) for way, port in ports.items()}
    turn_ms: dict[str, list[float]] = {DIRECT: [], PROXY: []}
    first_ms: dict[str, list[float]] = {DIRECT: [], PROXY: []}
    outside_ms: dict[str, list[float]] = {DIRECT: [], PROXY: []}
    compute_ms: dict[str, list[float]] = {DIRECT: [], PROXY: []}
    turn_tokens: dict[str, list[int]] = {DIRECT: [], PROXY: []}
    first_tokens: dict[str, list[int]] = {DIRECT: [], PROXY: []}
    compute = Compute(ports[DIRECT])
    spacer = Spacer(ports[DIRECT], SLOTS)
    cpu = 0.0
    turns = schedule(reps, streamed)
    try:
        for n, (stream, timed, again) in enumerate(turns):
            # Which way goes first changes from one timed turn of a kind to the next, so streamed and
            # non-streamed turns alike go first half the time (see _paired): a turn sent right after
            # another waits for the server's work after that one.
            kind = first_ms if stream else turn_ms
            order = (DIRECT, PROXY) if (len(kind[DIRECT]) if timed else n) % 2 == 0 else (PROXY, DIRECT)
            for way in order:
                if again:
                    talks[way].again(n)
                path, body = talks[way].request(stream=stream)
                before, started = rig.cpu_seconds(pid), time.monotonic()
                first, whole = conns[way].timed_both(path, body)
                if way == PROXY:
                    cpu += rig.cpu_seconds(pid) - before - idle * (time.monotonic() - started)
                spent, processed = compute.since()
                if n == 0:
                    spacer.note()
                spacer.run()
                compute.since()  # the spacer's own work is no turn's
                talks[way].grow(n)
                if not timed:
                    continue
                if stream:
                    first_ms[way].append(first)
                    outside_ms[way].append(first - spent)
                    first_tokens[way].append(processed)
                else:
                    turn_ms[way].append(whole)
                    compute_ms[way].append(spent)
                    turn_tokens[way].append(processed)
    finally:
        compute.close()
        spacer.close()
        for conn in conns.values():
            conn.close()
    found = Api(api, turn_ms, first_ms, cpu / len(turns) * 1e6, outside_ms, compute_ms, turn_tokens, first_tokens)
    say(
        f"  {api}: warm turn {rig.median(turn_ms[PROXY]):.1f} vs {rig.median(turn_ms[DIRECT]):.1f} ms direct "
        f"({found.turn_ratio():.3f}x for the same work, {found.ratio():.3f}x as measured); first byte "
        f"{found.first_added():+.2f} ms ({found.added():+.2f} ms as measured); {found.different_work()} pairs "
        f"where the proxy's turn made the server process more; {found.cpu_us:.0f} µs CPU per request"
    )
    return found


def _chat_turn(port: int, talk: Talk, line: str) -> tuple[float, int, int]:
    """A non-streamed chat turn (``line`` added) on a new connection: (ms to its end, its cache_n, its prompt's
    tokens)."""
    path, body = talk.request(stream=False, line=line)
    conn = proxy_mod.Conn(port)
    try:
        ms = conn.timed(path, body)
    finally:
        conn.close()
    timings = json.loads(conn.answer).get("timings", {})
    cache_n = int(timings.get("cache_n", -1))
    return ms, cache_n, cache_n + int(timings.get("prompt_n", 0))


def _crash(
    server: llamabed.LlamaServer, side: sidecarbed.SidecarProcess, port: int, *, tokens: int, reps: int, say: rig.Say
) -> Crash:
    """A proxied chat's next turn right after a kill -9 (from /health ok) against the same turn without one."""
    talk = Talk("chat completions", llamabed.make_prompt(server.url, tokens, seed=901))
    seen = len(side.log_events("snapshot_committed"))
    _, _, made = _chat_turn(port, talk, _line(0))  # cold: the conversation is made, then snapshotted

    def saved() -> bool:
        # Its own snapshot (the prompt and the reply's token), not a late one of the warm turns' conversations.
        return any(made <= int(e.get("tokens", 0)) <= made + 2 for e in side.log_events("snapshot_committed")[seen:])

    side.wait_for(saved, timeout=120, what="the conversation's snapshot")
    spacer = Spacer(server.port, SLOTS)
    spacer.note()
    crashed, calm, cache_n, calm_cache_n = [], [], [], []
    for r in range(reps):
        # Calm: the restore round after the last crash has ended, and the spacer has had the server copy
        # the slots it restored into its RAM prompt cache (the first task after a round does that, at the
        # server's defaults): the turn runs as any turn with no crash before it does.
        side.wait_for(lambda: side.get("/readyz")[0] == 200, timeout=60, what="the restore round's end")
        spacer.run()
        # The slot holds the conversation and an earlier line; this line starts with another word.
        ms, n, _ = _chat_turn(port, talk, _line(2 * r + 1))
        calm.append(ms)
        calm_cache_n.append(n)
        # Killed at once, long before the sidecar would save the grown slot: each crash restores the
        # same snapshot, the conversation and its first line.
        server.kill()
        server.start()
        server.wait_healthy(timeout=300)
        ms, n, _ = _chat_turn(port, talk, _line(2 * r + 2))
        crashed.append(ms)
        cache_n.append(n)
        say(f"  crash {r + 1}/{reps}: {ms:.1f} ms from /health ok (cache_n {n}) vs {calm[-1]:.1f} ms with no crash")
    spacer.close()
    return Crash(tokens, crashed, calm, cache_n, calm_cache_n)


def run(bed: rig.Rig, *, tokens: int, reps: int, streamed: int, crashes: int, quick: bool, say: rig.Say) -> Result:
    slot_dir = bed.slot_dir("price")
    server = bed.server(slot_dir=slot_dir, n_slots=SLOTS, ctx_size=CTX)
    proxy_port = net.free_port()
    side = bed.sidecar(server, slot_dir, **{"--proxy-listen": f"127.0.0.1:{proxy_port}"})
    wait.wait_until(lambda: side.get("/readyz")[0] == 200, timeout=60, what="the sidecar ready")
    assert side.proc is not None
    pid = side.proc.pid
    ports = {DIRECT: server.port, PROXY: proxy_port}
    idle = proxy_mod.idle_rate(pid)
    apis = []
    for i, api in enumerate(APIS):
        history = (
            llamabed.make_prompt(server.url, tokens, seed=300 + 2 * i),
            llamabed.make_prompt(server.url, tokens, seed=301 + 2 * i),
        )
        say(f"  {api}: {reps} warm turns and {streamed} streamed each way, ~{tokens:,}-token histories")
        apis.append(_turns(api, history, ports, pid, reps=reps, streamed=streamed, idle=idle, say=say))
    non_routed = proxy_mod.latencies(pid, ports, reps=100 if quick else 400, idle=idle, say=say)
    crash = _crash(server, side, proxy_port, tokens=tokens, reps=crashes, say=say)
    side.kill()
    server.kill()
    return Result(tokens, apis, non_routed, crash, quick)


def judged(r: Result) -> list[tuple[str, str, bool | None]]:
    """(goal, measured, met: None for NO VERDICT) of each goal."""
    out: list[tuple[str, str, bool | None]] = []
    for a in r.apis:
        parts = _parts(len(a.turn_ms[PROXY]))
        rounds = [a.turn_ratio(p) for p in parts]
        out.append(
            (
                f"price: {a.name}, warm turn through the proxy <= {TURN_GOAL:g}x direct at p50",
                f"{a.turn_ratio():.3f}x for the same work ({a.ratio():.3f}x as measured, "
                f"{rig.median(a.turn_ms[PROXY]):.1f} vs {rig.median(a.turn_ms[DIRECT]):.1f} ms; "
                f"per round {', '.join(f'{v:.3f}' for v in rounds)})",
                rig.decide(a.turn_ratio(), TURN_GOAL, rounds=rounds, quick=r.quick),
            )
        )
    for a in r.apis:
        parts = _parts(len(a.first_ms[PROXY]))
        rounds = [a.first_added(p) for p in parts]
        out.append(
            (
                f"price: {a.name}, first streamed byte through the proxy <= +{FIRST_BYTE_GOAL_MS:g} ms at p50",
                f"{a.first_added():+.2f} ms for the same work ({a.added():+.2f} ms as measured, "
                f"{rig.median(a.first_ms[PROXY]):.1f} vs {rig.median(a.first_ms[DIRECT]):.1f} "
                f"ms; per round {', '.join(f'{v:+.2f}' for v in rounds)}; {a.different_work()} pairs of either "
                "kind where the proxy's turn made the server process more)",
                rig.decide(a.first_added(), FIRST_BYTE_GOAL_MS, rounds=rounds, quick=r.quick),
            )
        )
    for lat in r.non_routed:
        parts = _parts(len(lat.proxy_ms))
        rounds = [_added(lat, p) for p in parts]
        added = _added(lat)
        out.append(
            (
                f"price: non-routed {lat.route} adds <= {NON_ROUTED_GOAL_MS:g} ms at p50",
                f"{added:+.3f} ms ({rig.percentile(lat.proxy_ms, 50):.2f} vs {rig.percentile(lat.direct_ms, 50):.2f} "
                f"ms; per round {', '.join(f'{v:+.3f}' for v in rounds)}; {lat.cpu_us:.0f} µs CPU per request)",
                rig.decide(added, NON_ROUTED_GOAL_MS, rounds=rounds, quick=r.quick),
            )
        )
    c = r.crash
    out.append(
        (
            f"price: the turn after a kill -9 (from /health ok) <= {CRASH_GOAL:g}x the same turn with no crash",
            f"{c.ratio:.3f}x ({rig.median(c.crashed_ms):.1f} vs {rig.median(c.calm_ms):.1f} ms; per crash "
            f"{', '.join(f'{v:.2f}' for v in c.ratios)}; cache_n {min(c.cache_n)}-{max(c.cache_n)} after, "
            f"{min(c.calm_cache_n)}-{max(c.calm_cache_n)} without)",
            None
            if min(c.cache_n) < 0.9 * c.tokens
            else rig.decide(c.ratio, CRASH_GOAL, rounds=c.ratios, quick=r.quick),
        )
    )
    return out


def verdicts(r: Result) -> list[str]:
    return [f"{rig.word(met):10}  {goal}: {measured}" for goal, measured, met in judged(r)]


def from_json(raw: dict[str, Any]) -> Result:
    """A run's result as ``results.json`` holds it."""
    return Result(
        raw["tokens"],
        [Api(**a) for a in raw["apis"]],
        [proxy_mod.Latency(**n) for n in raw["non_routed"]],
        Crash(**raw["crash"]),
        raw["quick"],
    )


def table(r: Result) -> str:
    rows = [
        [a.name, len(a.turn_ms[PROXY]), rig.median(a.turn_ms[DIRECT]), rig.median(a.turn_ms[PROXY]),
         f"{a.turn_ratio():.3f}", f"{a.ratio():.3f}", rig.median(a.first_ms[DIRECT]), rig.median(a.first_ms[PROXY]),
         a.first_added(), a.added(), a.different_work(), a.cpu_us]
        for a in r.apis
    ]  # fmt: skip
    head = [
        "API", "n", "turn direct", "turn proxy", "ratio", "as measured", "1st byte direct", "1st byte proxy",
        "added", "as measured", "more work", "CPU µs",
    ]  # fmt: skip
    note = (
        f"(ms, p50; ratio and added: over pairs of turns, per order, each proxied turn given the direct turn's "
        f"server compute (its /metrics) where the server processed at most {SAME_WORK_TOKENS} more prompt tokens "
        "for it; as measured: without; more work: pairs where it processed more, counted as measured; "
        "a spacer request on a third slot after each timed turn; "
        f"{SLOTS} slots of {CTX:,} tokens, "
        f"RAM prompt cache on; histories of ~{r.tokens:,} tokens; "
        "a turn adds an answer and a line; CPU: the sidecar's per proxied request, its polling subtracted)"
    )
    c = r.crash
    crash = rig.table(
        ["turn", "n", "p50 ms", "runs ms", "cache_n"],
        [
            ["after kill -9, from /health ok", len(c.crashed_ms), rig.median(c.crashed_ms),
             "/".join(f"{v:.0f}" for v in c.crashed_ms), "/".join(map(str, c.cache_n))],
            ["no crash", len(c.calm_ms), rig.median(c.calm_ms), "/".join(f"{v:.0f}" for v in c.calm_ms),
             "/".join(map(str, c.calm_cache_n))],
        ],
    )  # fmt: skip
    non = rig.table(
        ["non-routed request", "n", "p50 direct", "p50 proxy", "added", "CPU µs"],
        [[n.route, len(n.direct_ms), rig.percentile(n.direct_ms, 50), rig.percentile(n.proxy_ms, 50), _added(n),
          n.cpu_us] for n in r.non_routed],
    )  # fmt: skip
    return "\n\n".join([rig.table(head, rows, digits=2) + "\n" + note, non, crash, "\n".join(verdicts(r))])


def measure(bed: rig.Rig, *, quick: bool, say: rig.Say) -> tuple[Result, str]:
    result = run(
        bed,
        tokens=2000 if quick else 4000,
        reps=12 if quick else 30,
        streamed=24 if quick else STREAMED,
        crashes=3 if quick else CRASHES,
        quick=quick,
        say=say,
    )
    return result, table(result)


def main(argv: list[str] | None = None) -> int:
    return section.main(
        argv,
        name="price",
        doc=__doc__,
        title="The proxy's price per turn",
        quick_help="shorter histories, fewer turns and crashes",
        measure=measure,
        missed=lambda result, quick: any(met is False for _, _, met in judged(result)),
    )


if __name__ == "__main__":
    sys.exit(main())
