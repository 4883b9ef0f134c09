"""What the proxy (--proxy-listen) adds: latency of a non-streamed request, and gaps between streamed tokens.

One llama-server (-np 1) and one sidecar with the proxy on. Every request
goes to llama-server directly and through the proxy in turn, each way on its
own keep-alive connection, so drift in the machine's load hits both alike.

- Non-streamed: ``POST /tokenize`` (almost no server time, so the proxy's own
  cost shows plainly; a route that does not wait at the restore gate) and
  ``POST /completion`` with ``n_predict`` 1 on a cached prompt (a completion
  route: through the gate). Added latency is the proxy's percentile minus
  the direct one.
- Streamed: a long completion streamed for a few seconds, directly and
  through the proxy in alternating rounds; the gaps between consecutive
  token events (the wait for the first token is not a gap).

- Held streams: a streamed chat request held at the restore gate (llama-server
  killed, started again :data:`HELD_SECONDS` later) and one in a cold prefill
  of :data:`PREFILL_TOKENS` tokens; the time from sending it to the first
  byte of its answer (the proxy's status line, then keep-alives), and to its
  first event.

Targets: under 1 ms added at p50 for a non-streamed request; the p99 token
gap through the proxy within noise of the direct one, where noise is the
spread of the per-round p99s of the same path; a held stream's first byte
within 100 ms of its arrival, whatever the wait (an absolute bar: it is the
proxy's own answer, the wait behind it does not move it).

Run alone with ``python -m bench.proxy [--quick]``, or as the ``proxy``
section of ``python -m bench``.
"""

from __future__ import annotations

import dataclasses
import http.client
import itertools
import json
import socket
import sys
import time
from collections.abc import Callable

from bench import client, rig, section
from bench.beds import llamabed, net, sidecarbed, wait

DIRECT, PROXY = "direct", "proxy"
ADDED_P50_TARGET_MS = 1.0
FIRST_BYTE_GOAL_MS = 100.0
HELD_SECONDS = 1.5
PREFILL_TOKENS = 1000
PROMPT = "The proxy benchmark asks for one token after this short sentence."


@dataclasses.dataclass(frozen=True, slots=True)
class Latency:
    route: str
    direct_ms: list[float]
    proxy_ms: list[float]
    cpu_us: float
    """The sidecar's CPU time per proxied request (its idle polling subtracted), in microseconds."""

    def added(self, q: float) -> float:
        return rig.percentile(self.proxy_ms, q) - rig.percentile(self.direct_ms, q)


@dataclasses.dataclass(frozen=True, slots=True)
class Gaps:
    path: str
    rounds: list[list[float]]
    """Inter-token gaps (ms) of each round."""

    @property
    def pooled(self) -> list[float]:
        return [g for r in self.rounds for g in r]

    @property
    def round_p99s(self) -> list[float]:
        return [rig.percentile(r, 99) for r in self.rounds]


@dataclasses.dataclass(frozen=True, slots=True)
class Held:
    case: str
    first_byte_ms: list[float]
    """From sending the request to the first byte of its answer."""
    first_event_s: list[float]
    """From sending the request to its first event (the wait it was kept alive through)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Result:
    latencies: list[Latency]
    gaps: list[Gaps]
    held: list[Held] = dataclasses.field(default_factory=list)

    @property
    def noise_ms(self) -> float:
        """Spread of the per-round p99 gaps within one path, the larger of the two paths."""
        return max(max(g.round_p99s) - min(g.round_p99s) for g in self.gaps)

    def gap_p99(self, path: str) -> float:
        return rig.percentile(next(g for g in self.gaps if g.path == path).pooled, 99)


class Conn:
    """One keep-alive connection that times each request: to its answer's end, and to its body's first byte."""

    def __init__(self, port: int) -> None:
        self.http = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        self.reconnects = 0
        self.answer = b""
        """The last answer's body."""

    def timed(self, path: str, body: dict[str, object]) -> float:
        """Milliseconds from sending the request to the end of its answer."""
        return self.timed_both(path, body)[1]

    def timed_both(self, path: str, body: dict[str, object]) -> tuple[float, float]:
        """Milliseconds from sending the request to the first byte of its answer's body, and to its end."""
        try:
            return self._timed(path, body)
        except (http.client.HTTPException, OSError):
            # llama-server closes a kept-alive connection after 100 requests: time the request again
            # on a new connection.
            self.reconnects += 1
            self.http.close()
            return self._timed(path, body)

    def _timed(self, path: str, body: dict[str, object]) -> tuple[float, float]:
        data = json.dumps(body)
        started = time.perf_counter()
        self.http.request("POST", path, data, {"Content-Type": "application/json"})
        resp = self.http.getresponse()
        first = resp.read1(1)
        at_first = time.perf_counter()
        payload = first + resp.read()
        ended = time.perf_counter()
        if resp.status != 200:
            raise rig.BenchError(f"{path} answered HTTP {resp.status}: {payload[:300]!r}")
        self.answer = payload
        return (at_first - started) * 1000, (ended - started) * 1000

    def close(self) -> None:
        self.http.close()


def idle_rate(pid: int, seconds: float = 3.0) -> float:
    """The sidecar's CPU seconds per second while no request passes (its polling)."""
    cpu, started = rig.cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return (rig.cpu_seconds(pid) - cpu) / (time.monotonic() - started)


NON_ROUTED: dict[str, tuple[str, dict[str, object]]] = {
    "POST /tokenize": ("/tokenize", {"content": PROMPT}),
    "POST /completion, n_predict 1": (
        "/completion",
        {"prompt": PROMPT, "n_predict": 1, "temperature": 0, "cache_prompt": True, "id_slot": 0},
    ),
}
"""Requests the library does not route: a route that does not wait at the restore gate, and a completion that
picks its own slot (``id_slot``), through the gate."""


def latencies(
    pid: int, ports: dict[str, int], *, reps: int, idle: float, say: rig.Say, warmup: int = 20
) -> list[Latency]:
    """Each of :data:`NON_ROUTED` ``reps`` times each way, alternating, on one keep-alive connection per way."""
    out = []
    for route, (path, body) in NON_ROUTED.items():
        say(f"  {route}: {reps} requests each way, alternating")
        conns = {name: Conn(port) for name, port in ports.items()}
        try:
            for _ in range(warmup):  # warm-up: connections, the server's prompt cache
                for conn in conns.values():
                    conn.timed(path, body)
            times: dict[str, list[float]] = {DIRECT: [], PROXY: []}
            cpu, started = rig.cpu_seconds(pid), time.monotonic()
            for n in range(reps):
                order = (DIRECT, PROXY) if n % 2 == 0 else (PROXY, DIRECT)
                for name in order:
                    times[name].append(conns[name].timed(path, body))
            cpu = rig.cpu_seconds(pid) - cpu - idle * (time.monotonic() - started)
        finally:
            for conn in conns.values():
                conn.close()
        say(f"    reconnects: {', '.join(f'{name} {conn.reconnects}' for name, conn in conns.items())}")
        out.append(Latency(route, times[DIRECT], times[PROXY], cpu / reps * 1e6))
    return out


def first_byte(port: int, text: str, *, meanwhile: Callable[[], None] = lambda: None) -> tuple[float, float]:
    """A streamed chat request: (ms to its answer's first byte, s to its first event); ``meanwhile`` runs
    once it is sent (restarting the server it is held for)."""
    data = json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 2, "stream": True}).encode()
    head = "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=600) as sock:
        started = time.perf_counter()
        sock.sendall((head + f"Content-Length: {len(data)}\r\n\r\n").encode() + data)
        got = sock.recv(65536)
        first = time.perf_counter() - started
        meanwhile()
        while b"data: " not in got:
            chunk = sock.recv(65536)
            if not chunk:
                raise rig.BenchError(f"the stream ended before its first event: {got[:300]!r}")
            got += chunk
        if not got.startswith(b"HTTP/1.1 200"):
            raise rig.BenchError(f"the stream answered {got[:300]!r}")
        return first * 1000, time.perf_counter() - started


def held_streams(
    server: llamabed.LlamaServer, side: sidecarbed.SidecarProcess, port: int, *, reps: int, say: rig.Say
) -> list[Held]:
    """:data:`FIRST_BYTE_GOAL_MS`'s two cases, ``reps`` times each: held at the gate, and in a cold prefill."""
    out = []
    gate: tuple[list[float], list[float]] = ([], [])
    for n in range(reps):
        say(f"  held stream {n + 1}/{reps}: at the restore gate for {HELD_SECONDS:g} s")
        server.kill()
        wait.wait_until(lambda: side.get("/readyz")[0] != 200, timeout=30, what="the gate to close")

        def restart() -> None:
            time.sleep(HELD_SECONDS)  # the hold the stream is kept alive through
            server.start()

        ms, seconds = first_byte(port, f"Held turn {n}.", meanwhile=restart)
        server.wait_healthy(timeout=300)
        gate[0].append(ms)
        gate[1].append(seconds)
    out.append(Held("held at the restore gate", *gate))
    prefill: tuple[list[float], list[float]] = ([], [])
    for n in range(reps):
        say(f"  held stream {n + 1}/{reps}: a cold prefill of {PREFILL_TOKENS} tokens")
        rig.wait_idle(server.url)
        ms, seconds = first_byte(port, llamabed.make_prompt(server.url, PREFILL_TOKENS, seed=900 + n))
        prefill[0].append(ms)
        prefill[1].append(seconds)
    out.append(Held(f"in a cold prefill of {PREFILL_TOKENS} tokens", *prefill))
    return out


def run(bed: rig.Rig, *, reps: int, stream_seconds: float, rounds: int, say: rig.Say) -> Result:
    slot_dir = bed.slot_dir("proxy")
    server = bed.server(slot_dir=slot_dir, n_slots=1, ctx_size=4096)
    proxy_port = net.free_port()
    side = bed.sidecar(server, slot_dir, **{"--proxy-listen": f"127.0.0.1:{proxy_port}"})
    wait.wait_until(
        lambda: side.metric("llama_sidecar_server_up") == 1, timeout=60, what="the sidecar to see llama-server up"
    )
    ports = {DIRECT: server.port, PROXY: proxy_port}
    assert side.proc is not None
    pid = side.proc.pid
    found = latencies(pid, ports, reps=reps, idle=idle_rate(pid), say=say)

    gaps = {DIRECT: Gaps(DIRECT, []), PROXY: Gaps(PROXY, [])}
    for n in range(rounds):
        order = (DIRECT, PROXY) if n % 2 == 0 else (PROXY, DIRECT)
        for name in order:
            say(f"  streamed tokens, round {n + 1}/{rounds}: {name}, {stream_seconds:.0f} s")
            rig.wait_idle(server.url)
            arrivals: list[float] = []
            client.stream(ports[name], stream_seconds, arrivals)
            gaps[name].rounds.append([(b - a) * 1000 for a, b in itertools.pairwise(arrivals)])
    held = held_streams(server, side, proxy_port, reps=max(rounds, 2), say=say)
    return Result(found, [gaps[DIRECT], gaps[PROXY]], held)


def table(result: Result, *, quick: bool = False) -> str:
    rows = []
    for lat in result.latencies:
        rows.append(
            [
                lat.route,
                len(lat.direct_ms),
                rig.percentile(lat.direct_ms, 50),
                rig.percentile(lat.proxy_ms, 50),
                lat.added(50),
                rig.percentile(lat.direct_ms, 99),
                rig.percentile(lat.proxy_ms, 99),
                lat.added(99),
                lat.cpu_us,
            ]
        )
    head = ["non-streamed request", "n", "p50 direct", "p50 proxy", "added", "p99 direct", "p99 proxy", "added"]
    head.append("sidecar CPU/request")
    part1 = rig.table(head, rows) + "\n(ms; the sidecar's CPU time per proxied request in µs, its polling subtracted)"
    rows2 = []
    for g in result.gaps:
        pooled = g.pooled
        rows2.append(
            [
                g.path,
                len(pooled),
                rig.percentile(pooled, 50),
                rig.percentile(pooled, 99),
                ", ".join(f"{p:.1f}" for p in g.round_p99s),
            ]
        )
    part2 = rig.table(["streamed tokens", "gaps", "p50 gap", "p99 gap", "p99 per round"], rows2, digits=2)
    rows3 = [[h.case, len(h.first_byte_ms), max(h.first_byte_ms), max(h.first_event_s)] for h in result.held]
    part3 = rig.table(["held stream", "n", "first byte (ms, worst)", "first event (s, worst)"], rows3, digits=2)
    tables = [part1, part2 + "\n(ms)", part3] if result.held else [part1, part2 + "\n(ms)"]
    return "\n\n".join(tables) + "\n\n" + "\n".join(verdicts(result, quick=quick))


def judged(result: Result, *, quick: bool = False) -> list[tuple[str, str, bool | None]]:
    """(goal, measured, met: None for no verdict) for each target of this section."""
    out: list[tuple[str, str, bool | None]] = []
    for lat in result.latencies:
        added = lat.added(50)
        direct, via = rig.percentile(lat.direct_ms, 50), rig.percentile(lat.proxy_ms, 50)
        rounds = [
            rig.percentile(p, 50) - rig.percentile(d, 50)
            for p, d in zip(rig.halves(lat.proxy_ms), rig.halves(lat.direct_ms), strict=True)
        ]
        out.append(
            (
                f"proxy: {lat.route} adds < {ADDED_P50_TARGET_MS:g} ms at p50",
                f"{added:.3f} ms added at p50 ({via:.2f} ms through the proxy vs {direct:.2f} ms direct; "
                f"per half {', '.join(f'{v:.3f}' for v in rounds)})",
                rig.decide(added, ADDED_P50_TARGET_MS, rounds=rounds, quick=quick),
            )
        )
    direct, via = result.gap_p99(DIRECT), result.gap_p99(PROXY)
    noise = result.noise_ms
    out.append(
        (
            "proxy: p99 token gap within noise of the direct one",
            f"{via:.2f} ms through the proxy vs {direct:.2f} ms direct (ratio {via / direct:.3f}); noise, the "
            f"spread of per-round p99s: {noise:.2f} ms",
            via - direct <= noise,
        )
    )
    for held in result.held:
        worst = max(held.first_byte_ms)
        out.append(
            (
                f"proxy: a streamed request {held.case} gets its first byte within {FIRST_BYTE_GOAL_MS:g} ms",
                f"{worst:.1f} ms at worst of {len(held.first_byte_ms)} "
                f"({', '.join(f'{v:.1f}' for v in held.first_byte_ms)}), its first event after "
                f"{max(held.first_event_s):.1f} s at worst",
                worst <= FIRST_BYTE_GOAL_MS,
            )
        )
    return out


def verdicts(result: Result, *, quick: bool = False) -> list[str]:
    return [f"{rig.word(met):10}  {goal}: {measured}" for goal, measured, met in judged(result, quick=quick)]


def measure(bed: rig.Rig, *, quick: bool, say: rig.Say) -> tuple[Result, str]:
    result = run(
        bed,
        reps=100 if quick else 400,
        stream_seconds=4.0 if quick else 8.0,
        rounds=2 if quick else 4,
        say=say,
    )
    return result, table(result, quick=quick)


def main(argv: list[str] | None = None) -> int:
    return section.main(
        argv,
        name="proxy",
        doc=__doc__,
        title="Proxy overhead",
        quick_help="fewer requests and shorter streams",
        measure=measure,
        missed=lambda result, quick: any(met is False for _, _, met in judged(result, quick=quick)),
    )


if __name__ == "__main__":
    sys.exit(main())
