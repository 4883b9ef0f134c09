"""What the proxy adds to an agent's wait for its first streamed byte, per API, against llama-server direct.

One llama-server (-np 3, one slot per API) and one sidecar with the proxy
on. One agent conversation per API (Chat Completions, Anthropic Messages,
Responses: each a system prompt, a tool and a ~2,000-token history, as
coding agents send them) is streamed with ``max_tokens`` 1, directly and
through the proxy in turn, each way on its own connection, so that drift in
the machine's load hits both alike. Every request repeats its
conversation, so the server reuses all of the prompt but its last token,
both ways: what is timed is what a warm agent turn waits for, from sending
the request to the answer's first event (llama-server sends the status and
headers when prompt processing starts; the proxy holds them until that
event, or sends its own and keep-alives when it is slow to come, which are
skipped here).

Through the proxy each request is also routed: the conversion of the
Anthropic and Responses bodies, ``/apply-template`` and ``/tokenize`` on the
server, the choice of the slot. Goal: the p50 through the proxy at most
1.25x the direct p50, per API.

Run alone with ``python -m bench.agents [--quick]``, or as the ``agents``
section of ``python -m bench``.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import sys
import time
from typing import Any

from bench import client, rig, section
from bench.beds import llamabed, net, wait

DIRECT, PROXY = "direct", "proxy"
RATIO_GOAL = 1.25
"""The p50 time to the first streamed byte through the proxy over the direct p50."""
HISTORY_TOKENS = 2000
SYSTEM = "You are a coding agent. Answer in one short sentence."
SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}


def bodies(history: str) -> dict[str, tuple[str, dict[str, Any]]]:
    """The streamed request of each API (path, body), as its SDK sends it."""
    chat_tool = {"type": "function", "function": {"name": "read_file", "description": "Read", "parameters": SCHEMA}}
    return {
        "chat completions": (
            "/v1/chat/completions",
            {"model": "m", "stream": True, "max_tokens": 1, "temperature": 0, "tools": [chat_tool],
             "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": history}]},
        ),
        "anthropic messages": (
            "/v1/messages",
            {"model": "m", "stream": True, "max_tokens": 1, "temperature": 0, "system": SYSTEM,
             "tools": [{"name": "read_file", "description": "Read", "input_schema": SCHEMA}],
             "messages": [{"role": "user", "content": history}]},
        ),
        "responses": (
            "/v1/responses",
            {"model": "m", "stream": True, "max_output_tokens": 1, "temperature": 0, "store": False,
             "instructions": SYSTEM,
             "tools": [{"type": "function", "name": "read_file", "description": "Read", "parameters": SCHEMA}],
             "input": [{"type": "message", "role": "user", "content": history}]},
        ),
    }  # fmt: skip


@dataclasses.dataclass(frozen=True, slots=True)
class Api:
    name: str
    direct_ms: list[float]
    proxy_ms: list[float]

    @property
    def ratio(self) -> float:
        return rig.percentile(self.proxy_ms, 50) / rig.percentile(self.direct_ms, 50)

    def added(self, q: float) -> float:
        return rig.percentile(self.proxy_ms, q) - rig.percentile(self.direct_ms, q)


def first_byte(port: int, path: str, body: dict[str, Any]) -> float:
    """Milliseconds from sending a streamed request to its answer's first event (the proxy's keep-alives before it
    skipped); reads it to the end."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        data = json.dumps(body)
        started = time.perf_counter()
        conn.request("POST", path, data, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        first = client.first_event(resp)
        elapsed = (time.perf_counter() - started) * 1000
        rest = resp.read()
        if resp.status != 200 or not first:
            raise rig.BenchError(f"{path} answered HTTP {resp.status}: {(first + rest)[:300]!r}")
        return elapsed
    finally:
        conn.close()


def run(bed: rig.Rig, *, reps: int, say: rig.Say) -> list[Api]:
    slot_dir = bed.slot_dir("agents")
    server = bed.server(slot_dir=slot_dir, n_slots=3, ctx_size=4096)
    proxy_port = net.free_port()
    side = bed.sidecar(server, slot_dir, **{"--proxy-listen": f"127.0.0.1:{proxy_port}"})
    wait.wait_until(lambda: side.get("/readyz")[0] == 200, timeout=60, what="the sidecar ready")
    ports = {DIRECT: server.port, PROXY: proxy_port}
    history = llamabed.make_prompt(server.url, HISTORY_TOKENS, seed=77)
    out = []
    for name, (path, body) in bodies(history).items():
        say(f"  {name}: {reps} streamed requests each way, alternating")
        for _ in range(3):  # warm-up: the conversation in its slot, the connections' first use
            for port in ports.values():
                first_byte(port, path, body)
        times: dict[str, list[float]] = {DIRECT: [], PROXY: []}
        for n in range(reps):
            order = (DIRECT, PROXY) if n % 2 == 0 else (PROXY, DIRECT)
            for way in order:
                rig.wait_idle(server.url)
                times[way].append(first_byte(ports[way], path, body))
        out.append(Api(name, times[DIRECT], times[PROXY]))
    return out


def table(apis: list[Api], *, quick: bool = False) -> str:
    rows = [
        [a.name, len(a.direct_ms), rig.percentile(a.direct_ms, 50), rig.percentile(a.proxy_ms, 50), a.added(50),
         rig.percentile(a.direct_ms, 90), rig.percentile(a.proxy_ms, 90), a.ratio]
        for a in apis
    ]  # fmt: skip
    head = ["streamed request", "n", "p50 direct", "p50 proxy", "added", "p90 direct", "p90 proxy", "ratio p50"]
    note = "(ms to the first byte of the answer's body; warm prompts of about 2,000 tokens, max_tokens 1)"
    return rig.table(head, rows) + "\n" + note + "\n\n" + "\n".join(verdicts(apis, quick=quick))


def judged(apis: list[Api], *, quick: bool = False) -> list[tuple[str, str, bool | None]]:
    """(goal, measured, met: None for no verdict) for each API."""
    out: list[tuple[str, str, bool | None]] = []
    for a in apis:
        rounds = [
            rig.percentile(p, 50) / rig.percentile(d, 50)
            for p, d in zip(rig.halves(a.proxy_ms), rig.halves(a.direct_ms), strict=True)
        ]
        out.append(
            (
                f"agents: {a.name}, first streamed byte through the proxy <= {RATIO_GOAL:g}x direct at p50",
                f"{a.ratio:.3f}x ({rig.percentile(a.proxy_ms, 50):.1f} ms vs {rig.percentile(a.direct_ms, 50):.1f} "
                f"ms direct; {a.added(50):.1f} ms added; per half {', '.join(f'{v:.3f}' for v in rounds)})",
                rig.decide(a.ratio, RATIO_GOAL, rounds=rounds, quick=quick),
            )
        )
    return out


def verdicts(apis: list[Api], *, quick: bool = False) -> list[str]:
    return [f"{rig.word(met):10}  {goal}: {measured}" for goal, measured, met in judged(apis, quick=quick)]


def measure(bed: rig.Rig, *, quick: bool, say: rig.Say) -> tuple[list[Api], str]:
    apis = run(bed, reps=10 if quick else 40, say=say)
    return apis, table(apis, quick=quick)


def main(argv: list[str] | None = None) -> int:
    return section.main(
        argv,
        name="agents",
        doc=__doc__,
        title="Agents: time to the first streamed byte",
        quick_help="fewer requests",
        measure=measure,
        missed=lambda apis, quick: any(met is False for _, _, met in judged(apis, quick=quick)),
    )


if __name__ == "__main__":
    sys.exit(main())
