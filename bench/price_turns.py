"""The proxy's price, the turns: a conversation per API grown a turn at a time, both ways side by side, a spacer
after every timed turn, and the turn after a kill -9; :func:`bench.price.run` runs them.
"""

from __future__ import annotations

import copy
import http.client
import json
import time
from typing import Any

from bench import agents, rig
from bench import proxy as proxy_mod
from bench.beds import llamabed, sidecarbed
from bench.price_figures import DIRECT, PROXY, Api, Crash

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
    17 ms on these histories, see :func:`bench.price_figures._paired`): without the spacer it falls on whichever
    way goes next.
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


def run_turns(
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


def run_crash(
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
