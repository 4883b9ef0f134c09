"""Nodes: two llama-servers behind HAProxy, the shipped config against round robin, and a node's kill -9.

Two nodes (each a llama-server with 4 slots and a sidecar with
``--proxy-listen``, ``--agent-check-listen`` and one shared store: a real S3
server, ``support.s3bed``) on loopback, the test model, the sidecar's
defaults. Two HAProxies (Debian's package) stand in front of the same two
nodes: one with the shipped ``deploy/haproxy/haproxy.cfg``, one with the same
config and ``balance roundrobin`` in place of its hash (both as
``support.haproxybed`` adapts them: ports, server lines, faster checks).

Conversations (two agents' system prompts, each its own first message of
about 1,500 tokens) take turns through one balancer, then others as many
through the other; each round of turns is sent in a shuffled order (the
same for both), after every node has saved and uploaded what it serves.
Through the shipped config, coding agents' conversations take their turns
in the same rounds: ~2,700 tokens to start (a system prompt of ~2,000
shared by the agent's conversations, and a first message), answers of
:data:`ANSWER_TOKENS` and a tool's output of ~300 tokens each returning turn.
Figures:

* **warm returning turns**: a turn after the first is warm when its
  ``timings.cache_n`` is at least 90% of the turn before's prompt and its
  node fetched nothing from the shared store for it
  (``conversation_requests_total{source="shared"}``); the shipped config's
  share beside round robin's;
* **kill -9**: after the shipped config's turns, the llama-server of the
  node holding conversation 0 is ``kill -9``ed; once HAProxy shows it down,
  every conversation sends its next turn. For the conversations of the dead
  node: tokens reused over the previous prompt, and their time against the
  same turn of the conversations of the same kind that stayed (no failure
  for them, same node, same sizes): the agents' turns are the users' case,
  the short ones (~0.2 s) the worst case, where a move's fixed cost weighs
  most;
* **bounded load**: before the conversations, a burst of requests of one
  session (one ``x-session-id``: one key, one node on the ring) sent at once
  through the shipped config; the busiest node's share of them against the
  config's ``hash-balance-factor``, which bounds a node's requests in flight
  at that factor times the average. The conversations per node are printed
  beside, with how often a fair coin per conversation splits them at least as
  unevenly: the factor does not bound them (turns sent one at a time never
  put two requests in flight), the hash alone spreads them.

Goals (issue 45): the shipped config's returning turns at least 95% warm
(round robin's printed beside), the dead node's conversations at least 90%
cached, the agents' turns at most 1.5x the time of the turn without a
failure (the short turns' ratio printed beside, no goal), and the
burst's busiest node within the balance factor (1.5x the mean, rounded up
to a whole request). MET or MISSED each, exit status 1
on a miss.

Run alone with ``python -m bench.nodes [--quick]``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import json
import math
import random
import re
import secrets
import statistics
import sys
import time
import urllib.request
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from bench import REPO_ROOT, rig
from bench.beds import haproxybed, llamabed, net, nodechats, s3bed

NODES = ("node-a", "node-b")
SHIPPED, ROUND_ROBIN = "shipped config", "round robin"
FIRST_TOKENS = 1500
"""A first message long enough that fetching its snapshot beats prefilling it."""
AGENT_SYSTEM_TOKENS, AGENT_FIRST_TOKENS, TOOL_TOKENS, ANSWER_TOKENS = 2000, 700, 300, 128
"""A coding agent's conversation: a system prompt shared by the agent's conversations (its instructions and
tools) and a first message, ~2,700 tokens together (Claude Code's and Codex's prompts, trimmed to one tool or their
shell tools, are 2.7K and 2.6K: ``tests/support/agentclis.py``); each returning turn adds a tool's output and the
answer before it. An answer of 128 tokens is a tool call with a sentence before it (a file read, a shell command),
the shortest kind of turn an agent CLI makes: edits and explanations run to hundreds of tokens, which would
divide a move's fixed cost further."""
SLOTS = 4
CTX = 8192
"""Tokens per slot: an agent's conversation grows by ~450 a turn from ~2,700."""
WARM = 0.9
WARM_GOAL, CACHED_GOAL, TIME_GOAL, SPREAD_GOAL = 0.95, 0.90, 1.5, 1.5
LISTING_EXPIRES = 5.0
"""Seconds a node reuses its listing of the shared store (``sidecar.shared.catalog.REFRESH_EVERY``)."""
BUCKET = "llama-kv-bench"


class Node:
    def __init__(self, name: str, server: llamabed.LlamaServer, side: Any, proxy: int, agent: int) -> None:
        self.name, self.server, self.side, self.proxy, self.agent = name, server, side, proxy, agent

    def fetched(self) -> float:
        return nodechats.fetches(self.side)

    def settled(self) -> bool:
        return nodechats.settled(self.side)


Chat = nodechats.Chat


def _warm(chat: Chat, turn: int) -> bool:
    """Turn ``turn`` (0-based) reused at least :data:`WARM` of the turn before's prompt, and no fetch served it."""
    return chat.reused(turn) >= WARM and not chat.fetched[turn]


@dataclasses.dataclass(frozen=True, slots=True)
class Phase:
    name: str
    spread: dict[str, int]
    """Conversations per node, by the node of their first turn."""
    returning: int
    warm: int
    fetched: int
    reused: float
    """Tokens reused over the previous prompts, all returning turns."""


@dataclasses.dataclass(frozen=True, slots=True)
class Result:
    conversations: int
    turns: int
    phases: list[Phase]
    dead: str
    moved_reused: list[float]
    moved_fetched: int
    moved_seconds: list[float]
    stayed_seconds: list[float]
    moved_before_seconds: list[float]
    """The moved conversations' turn before the kill, on their own node."""
    moved_server_seconds: list[float] = dataclasses.field(default_factory=list)
    """llama-server's own time for the moved conversations' turn (its answer's prompt and generation timings)."""
    stayed_server_seconds: list[float] = dataclasses.field(default_factory=list)
    moved_steps: list[dict[str, float]] = dataclasses.field(default_factory=list)
    """Where each moved turn's placement went on the surviving node, from its log: seconds per step."""
    stayed_placing: list[float] = dataclasses.field(default_factory=list)
    """Seconds the surviving node took to place each turn of the conversations that stayed."""
    burst: dict[str, int] = dataclasses.field(default_factory=dict)
    """The requests of one session sent at once through the shipped config, per node that took them."""
    factor: float = SPREAD_GOAL
    """The shipped config's ``hash-balance-factor``, over 100."""
    paired: list[float] = dataclasses.field(default_factory=list)
    """Each moved turn over the turns that stayed sent just before and after it (:func:`_paired`)."""
    agents: Kill | None = None
    """The agents' conversations (:data:`ANSWER_TOKENS` a turn) after the same kill: the users' case."""
    load: str = ""
    """The machine's load when the node was killed."""
    short: Kill | None = None
    """The short conversations after the kill (the fields above, with their turn's sizes)."""

    @property
    def burst_bound(self) -> int:
        """The most requests of the burst a node may take: the factor times the mean, rounded up."""
        return math.ceil(self.factor * sum(self.burst.values()) / len(NODES))

    @property
    def uneven_odds(self) -> float:
        """How often a fair coin per conversation splits the shipped config's conversations at least as unevenly."""
        spread = self.phases[0].spread
        n, top = sum(spread.values()), max(spread.values())
        tail = sum(math.comb(n, k) for k in range(n + 1) if max(k, n - k) >= top)
        return tail / (1 << n)

    @property
    def time_ratio(self) -> float:
        """The short turns' figure (the worst case): the median of the moved turns, each over its neighbours that
        stayed."""
        return statistics.median(self.paired) if self.paired else float("nan")

    @property
    def kills(self) -> list[tuple[str, Kill]]:
        short = Kill(
            self.moved_reused, self.moved_fetched, self.moved_seconds, self.stayed_seconds,
            self.paired, self.moved_server_seconds, self.stayed_server_seconds, self.moved_steps, self.stayed_placing,
        )  # fmt: skip
        return [("short turns", self.short or short)] + ([("agents' turns", self.agents)] if self.agents else [])


@dataclasses.dataclass(frozen=True, slots=True)
class Kill:
    """One kind of conversation after the kill: those that moved to the survivor, and those that stayed."""

    moved_reused: list[float]
    moved_fetched: int
    moved_seconds: list[float]
    stayed_seconds: list[float]
    paired: list[float]
    """Each moved turn over the turns of the same kind that stayed, sent just before and after it."""
    moved_server_seconds: list[float]
    stayed_server_seconds: list[float]
    moved_steps: list[dict[str, float]]
    stayed_placing: list[float]
    prompt_tokens: int = 0
    """The median prompt of the turn after the kill."""
    answer_tokens: int = 0
    same: list[float] = dataclasses.field(default_factory=list)
    """:attr:`paired` with the same generation time on both sides (``_paired(same_generation=True)``)."""

    @property
    def ratio(self) -> float:
        return statistics.median(self.paired) if self.paired else float("nan")

    @property
    def same_ratio(self) -> float:
        """The goal's figure: the median of :attr:`same`."""
        return statistics.median(self.same) if self.same else float("nan")


def round_robin(config: str) -> str:
    """The bed's config with round robin in place of the conversation's hash."""
    config, n = re.subn(r"(?m)^    balance hash .*$", "    balance roundrobin", config)
    if n != 1:
        raise rig.BenchError("the shipped config has no 'balance hash' line")
    return re.sub(r"(?m)^    hash-(type|balance-factor) .*\n", "", config)


BURST = 8
"""Requests of one session sent at once through the shipped config, to see its bounded load at work."""


def balance_factor() -> float:
    """The shipped config's ``hash-balance-factor``, over 100."""
    found = re.search(r"(?m)^    hash-balance-factor (\d+)$", haproxybed.CONFIG.read_text())
    if found is None:
        raise rig.BenchError("the shipped config has no 'hash-balance-factor' line")
    return int(found.group(1)) / 100


def _burst(url: str, n: int) -> dict[str, int]:
    """``n`` short requests of one session sent at once through ``url``: how many each node took."""
    body = json.dumps({"messages": [{"role": "user", "content": "Say one word."}], "max_tokens": 16}).encode()

    def send() -> str:
        headers = {"content-type": "application/json", "x-session-id": "one-agent"}
        req = urllib.request.Request(url + "/v1/chat/completions", data=body, headers=headers)
        with urllib.request.urlopen(req, timeout=600) as resp:
            resp.read()
            return str(resp.headers["x-node"])

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        took = list(pool.map(lambda _: send(), range(n)))
    return {node: took.count(node) for node in NODES if node in took}


def _ready(side: Any) -> Callable[[], bool]:
    return lambda: bool(side.get("/readyz")[0] == 200)


def _settle(nodes: list[Node]) -> None:
    for node in nodes:
        node.side.wait_for(node.settled, timeout=300, what=f"{node.name}'s slots saved and uploaded")
    time.sleep(LISTING_EXPIRES + 0.5)


def _round(chats: list[Chat], url: str, nodes: dict[str, Node], order: random.Random | None) -> list[Chat]:
    """One turn of each conversation, in ``order`` (else as listed); the conversations in the order sent."""
    todo = list(chats)
    if order is not None:
        order.shuffle(todo)
    for chat in todo:
        chat.turn(url, {name: node.fetched for name, node in nodes.items()})
    return todo


def _paired(sent: list[Chat], moved: list[Chat], turn: int, *, same_generation: bool = False) -> list[float]:
    """Each moved conversation's turn ``turn`` over that of the conversations that stayed sent nearest before and
    after it: the same turn on the same node, side by side in time (what the machine's load does to one does it
    to the other).

    ``same_generation``: the moved turn counted with its neighbours' generation time in place of its own. Both
    generate the same number of tokens from a cache of the same length, work the move does not change; on a
    shared machine its time swings from 2 s to 58 s with the other work, and buried the move's cost (as the
    proxy's price section counts a proxied turn with the direct turn's compute). What the move changes stays:
    the placement, the download and swap, the prompt tokens the survivor re-reads, the balancer."""
    ratios = []
    for i, chat in enumerate(sent):
        if chat not in moved:
            continue
        before = [c for c in reversed(sent[:i]) if c not in moved][:1]
        after = [c for c in sent[i + 1 :] if c not in moved][:1]
        if before or after:
            stayed = before + after
            took = chat.seconds[turn]
            if same_generation:
                took += statistics.mean(c.generation_seconds[turn] for c in stayed) - chat.generation_seconds[turn]
            ratios.append(took / statistics.mean(c.seconds[turn] for c in stayed))
    return ratios


def _phase(name: str, chats: list[Chat], turns: int) -> Phase:
    spread = {node: sum(c.nodes[0] == node for c in chats) for node in NODES}
    returning = [(c, t) for c in chats for t in range(1, turns)]
    return Phase(
        name,
        spread,
        len(returning),
        sum(_warm(c, t) for c, t in returning),
        sum(c.fetched[t] for c, t in returning),
        sum(c.cached[t] for c, t in returning) / sum(c.prompts[t - 1] for c, t in returning),
    )


def _steps(side: Any, since: float) -> list[dict[str, float]]:
    """From ``side``'s log after Unix time ``since``: each placement in the order of the requests, in seconds (the
    whole placement, and for one served from the shared store its steps: tokenize, lookup, download, swap)."""

    def after(event: str) -> list[dict[str, Any]]:
        return [e for e in side.log_events(event) if datetime.fromisoformat(e["timestamp"]).timestamp() >= since]

    routed = after("request_routed")
    found = [e for e in after("shared_prefix_found") if e["verdict"] == "fetch"]
    swaps = {e["file"]: float(e["seconds"]) for e in after("conversation_swapped_in")}
    shared = iter(zip(found, after("shared_snapshot_fetched"), strict=False))
    steps = []
    for placed in routed:
        step = {"placement": float(placed["seconds"])}
        if placed["source"] == "shared" and (pair := next(shared, None)) is not None:
            looked, fetched = pair
            step |= {
                "tokenize": float(placed.get("tokenize_seconds", 0.0)),
                "lookup": float(looked["lookup_seconds"]),
                "download": float(fetched["seconds"]),
                "swap": swaps.get(fetched["file"], float("nan")),
            }
        steps.append(step)
    return steps


def _kill(sent: list[Chat], kind: list[Chat], dead: str, turn: int, steps: list[dict[str, float]]) -> Kill:
    """The conversations of ``kind`` after the kill: those whose turn before was on ``dead`` against the others.
    ``steps``: the survivor's placements, one per conversation of ``sent`` in that order."""
    moved = [c for c in kind if c.nodes[turn - 1] == dead]
    stayed = [c for c in kind if c not in moved]
    placed = dict(zip((id(c) for c in sent), steps, strict=False)) if len(steps) == len(sent) else {}
    return Kill(
        [c.reused(turn) for c in moved],
        sum(c.fetched[turn] for c in moved),
        [c.seconds[turn] for c in moved],
        [c.seconds[turn] for c in stayed],
        _paired([c for c in sent if c in kind], moved, turn),
        [c.server_seconds[turn] for c in moved],
        [c.server_seconds[turn] for c in stayed],
        [placed[id(c)] for c in moved if id(c) in placed and "download" in placed[id(c)]],
        [placed[id(c)]["placement"] for c in stayed if id(c) in placed],
        int(statistics.median(c.prompts[turn] for c in kind)),
        int(statistics.median(c.answered[turn] for c in kind)),
        _paired([c for c in sent if c in kind], moved, turn, same_generation=True),
    )


def _tool_output(outputs: list[str], sent: int) -> str:
    """The user message after the agent's turn ``sent`` (1-based): the output of the tool that turn called."""
    return "Tool output:\n" + outputs[sent - 1]


def agent_chats(url: str, count: int, turns: int) -> list[Chat]:
    """``count`` coding agents' conversations (:data:`AGENT_SYSTEM_TOKENS` and the others), two agents' system
    prompts between them; their tools' outputs for ``turns`` turns made ahead (with ``url``'s tokenizer, the node
    that is killed later)."""
    systems = [llamabed.make_prompt(url, AGENT_SYSTEM_TOKENS, seed=700 + a) for a in range(2)]
    chats = []
    for n in range(count):
        tools = [llamabed.make_prompt(url, TOOL_TOKENS, seed=10_000 + 100 * n + t) for t in range(turns + 1)]
        chats.append(
            Chat(
                n,
                llamabed.make_prompt(url, AGENT_FIRST_TOKENS, seed=800 + n),
                system=systems[n % 2],
                answer_tokens=ANSWER_TOKENS,
                follow=functools.partial(_tool_output, tools),
            )
        )
    return chats


def run(bed: rig.Rig, *, conversations: int, agents: int, turns: int, say: rig.Say) -> Result:
    s3 = s3bed.S3Server(bed.work / "s3")
    balancers: list[Any] = []
    try:
        s3.start()
        s3.create_bucket(BUCKET)
        store = f"s3://{BUCKET}/nodes-{secrets.token_hex(4)}"
        nodes: dict[str, Node] = {}
        for name in NODES:
            slot_dir = bed.slot_dir(f"nodes-{name}")
            server = bed.server(slot_dir=slot_dir, n_slots=SLOTS, ctx_size=CTX, alone=False)
            proxy, agent = net.free_port(), net.free_port()
            options = {
                "--log-level": "debug",  # each request's placement and its steps, timed (``request_routed``)
                "--proxy-listen": f"127.0.0.1:{proxy}",
                "--agent-check-listen": f"127.0.0.1:{agent}",
                "--shared-store": store,
            }
            side = bed.sidecar_with(server, slot_dir, options, env=s3.env())
            side.wait_for(_ready(side), timeout=120, what=f"{name} ready")
            nodes[name] = Node(name, server, side, proxy, agent)
        ports = {name: (node.proxy, node.agent) for name, node in nodes.items()}
        for way in (SHIPPED, ROUND_ROBIN):
            workdir = bed.slot_dir("haproxy-" + ("shipped" if way == SHIPPED else "roundrobin"))
            balancer = haproxybed.HAProxy(workdir, ports)
            if way == ROUND_ROBIN:
                balancer.path.write_text(round_robin(balancer.path.read_text()))
            balancers.append(balancer)
            balancer.start()
            for name in NODES:
                balancer.wait_status(name, "UP", timeout=120)
        shipped, robin = balancers
        burst = _burst(shipped.url, BURST)
        say(f"  a burst of {BURST} requests of one session: {burst}")
        url0 = nodes[NODES[0]].server.url
        # Round robin first: the kill -9 ends the shipped config's phase.
        # The agents' conversations take their turns through the shipped config, mixed into its short ones.
        coding = agent_chats(url0, agents, turns)
        chats: dict[str, list[Chat]] = {}
        for way, balancer, seed in ((ROUND_ROBIN, robin, 600), (SHIPPED, shipped, 450)):
            chats[way] = [
                Chat(n, llamabed.make_prompt(url0, FIRST_TOKENS, seed=seed + n)) for n in range(conversations)
            ]
            both = chats[way] + (coding if way == SHIPPED else [])
            for t in range(turns):
                if t:
                    _settle(list(nodes.values()))
                _round(both, balancer.url, nodes, random.Random(t) if t else None)
                say(f"  {way}: turn {t + 1} of {turns} sent by {len(both)} conversations")
        mine = chats[SHIPPED]
        dead = nodes[mine[0].nodes[-1]]
        alive = next(node for node in nodes.values() if node is not dead)
        _settle(list(nodes.values()))
        dead.server.kill()
        shipped.wait_status(dead.name, "DOWN", timeout=60)
        killed, load = time.time(), rig.busy()
        sent = _round(mine + coding, shipped.url, nodes, random.Random(turns))
        steps = _steps(alive.side, killed)
        if len(steps) != len(sent):
            say(f"  {alive.name} logged {len(steps)} placements for {len(sent)} turns: no steps per turn")
        brief, agentic = (_kill(sent, kind, dead.name, turns, steps) for kind in (mine, coding))
        say(
            f"  after the kill -9 of {dead.name}: {len(brief.moved_seconds)} conversations and "
            f"{len(agentic.moved_seconds)} agents' moved, {len(brief.stayed_seconds)} and "
            f"{len(agentic.stayed_seconds)} stayed"
        )
        return Result(
            conversations,
            turns,
            [_phase(SHIPPED, mine, turns), _phase(ROUND_ROBIN, chats[ROUND_ROBIN], turns)],
            dead.name,
            brief.moved_reused,
            brief.moved_fetched,
            brief.moved_seconds,
            brief.stayed_seconds,
            [c.seconds[turns - 1] for c in mine if c.nodes[turns - 1] == dead.name],
            brief.moved_server_seconds,
            brief.stayed_server_seconds,
            brief.moved_steps,
            brief.stayed_placing,
            burst,
            balance_factor(),
            brief.paired,
            agentic,
            load,
            brief,
        )
    finally:
        for balancer in balancers:
            balancer.stop()
        s3.stop()


def _share(part: int, whole: int) -> str:
    return f"{part / whole:.0%} ({part} of {whole})" if whole else "-"


def table(r: Result) -> str:
    agents = len(r.agents.moved_seconds) + len(r.agents.stayed_seconds) if r.agents else 0
    head = (
        f"{r.conversations} conversations (two agents, first messages of ~{FIRST_TOKENS:,} tokens), {r.turns} turns "
        f"each through each balancer, on 2 nodes of {SLOTS} slots with one shared S3 store; through the shipped "
        f"config beside them {agents} coding agents' conversations (~{AGENT_SYSTEM_TOKENS + AGENT_FIRST_TOKENS:,} "
        f"tokens to start, a system prompt of ~{AGENT_SYSTEM_TOKENS:,} shared per agent; each returning turn a "
        f"tool's output of ~{TOOL_TOKENS} tokens; answers of {ANSWER_TOKENS} tokens); then kill -9 of {r.dead}'s "
        "llama-server and one more turn of every conversation through the shipped config\n\n"
    )
    rows = [
        (p.name, "/".join(str(p.spread[n]) for n in NODES), _share(p.warm, p.returning), p.fetched, p.reused)
        for p in r.phases
    ]
    phases = rig.table(["balancer", "convs per node", "returning turns warm", "fetched", "reused"], rows)
    nan = float("nan")

    def med(values: list[float]) -> float:
        return statistics.median(values) if values else nan

    moved = rig.table(
        ["after kill -9", "prompt", "answer", "moved", "min reused", "fetched", "moved s", "no failure s", "ratios",
         "ratio", "same generation", "ratio, same generation"],
        [
            (name, k.prompt_tokens, k.answer_tokens, len(k.moved_seconds), min(k.moved_reused, default=nan),
             k.moved_fetched, med(k.moved_seconds), med(k.stayed_seconds),
             " ".join(f"{x:.2f}" for x in sorted(k.paired)), k.ratio,
             " ".join(f"{x:.2f}" for x in sorted(k.same)), k.same_ratio)
            for name, k in r.kills
        ],
        digits=2,
    )  # fmt: skip

    def step(k: Kill, name: str) -> float:
        return med([s[name] for s in k.moved_steps if name in s])

    steps: list[tuple[object, ...]] = []
    for name, k in r.kills:
        placing = step(k, "placement")
        steps += [
            (f"{name}, moved", med(k.moved_seconds), med(k.moved_server_seconds), placing, step(k, "tokenize"),
             step(k, "lookup"), step(k, "download"), step(k, "swap"),
             med(k.moved_seconds) - med(k.moved_server_seconds) - placing),
            (f"{name}, stayed", med(k.stayed_seconds), med(k.stayed_server_seconds), med(k.stayed_placing), nan, nan,
             nan, nan, med(k.stayed_seconds) - med(k.stayed_server_seconds) - med(k.stayed_placing)),
        ]  # fmt: skip
    where = rig.table(
        ["after kill -9, medians s", "whole turn", "llama-server", "placement", "tokenize", "lookup", "download",
         "swap", "the rest"],
        steps,
        digits=3,
    )  # fmt: skip
    before = statistics.median(r.moved_before_seconds) if r.moved_before_seconds else nan
    tail = (
        f"\n\n'prompt', 'answer': tokens of the turn after the kill (medians); 'moved': conversations of {r.dead}, "
        "continued on the survivor; 'no failure s': the same turn of the conversations of the same kind that stayed "
        "on their node; 'ratios': each moved turn over the turns of its kind that stayed sent just before and after "
        "it (the same turn, side by side in time), 'ratio' their median; 'same generation': the same with the moved "
        "turn counted with its neighbours' generation time in place of its own (the same tokens generated; the "
        "agents' median is the goal's figure, the short turns' the worst case); the moved short conversations' turn "
        f"before the kill took {before:.2f} s (median); "
        f"{r.load} at the kill"
    )
    why = (
        "\n\nWhere the time went: 'llama-server' is the server's own prompt and generation time (its answer's "
        "timings); 'placement' the surviving node's sidecar placing the request (its log), of which the moved "
        "turns' steps: 'tokenize' (template and tokens), 'lookup' (the shared store's listing), 'download' (fetch, "
        "check, commit), 'swap' (the slot's save if needed, and the restore); 'the rest' the balancer, the "
        "proxies and the client."
    )
    return head + phases + "\n\n" + moved + tail + "\n\n" + where + why


def verdicts(r: Result) -> list[str]:
    shipped, robin = r.phases
    warm = shipped.warm / shipped.returning
    reused = r.moved_reused + (r.agents.moved_reused if r.agents else [])
    users = r.agents.same_ratio if r.agents else float("nan")
    raw = r.agents.ratio if r.agents else float("nan")
    short = r.short.same_ratio if r.short else float("nan")
    checks = [
        (warm >= WARM_GOAL, f"returning turns warm with the shipped config at least {WARM_GOAL:.0%}",
         f"{warm:.1%} (round robin {robin.warm / robin.returning:.1%})"),
        (bool(reused) and min(reused) >= CACHED_GOAL,
         f"the dead node's conversations at least {CACHED_GOAL:.0%} cached on their next turn",
         ", ".join(f"{x:.1%}" for x in reused) or "none moved"),
        (users <= TIME_GOAL, f"the dead node's agents' next turn at most {TIME_GOAL}x the same turn without a failure",
         f"{users:.2f}x with the same generation time ({raw:.2f}x as timed; short turns, the worst case, no goal: "
         f"{short:.2f}x, {r.time_ratio:.2f}x as timed)"),
        (bool(r.burst) and max(r.burst.values()) <= r.burst_bound,
         f"one session's requests in flight at once: the busiest node at most {r.factor:g}x the mean "
         f"(hash-balance-factor), {r.burst_bound} of {sum(r.burst.values())}",
         f"{max(r.burst.values(), default=0)} ({'/'.join(str(r.burst.get(n, 0)) for n in NODES)}); conversations "
         f"{'/'.join(str(shipped.spread[n]) for n in NODES)}, a split a fair coin gives {r.uneven_odds:.0%} of the "
         "time (not bounded by the factor: one turn in flight at a time)"),
    ]  # fmt: skip
    return [("MET  " if met else "MISSED ") + f"{goal}: {figure}" for met, goal, figure in checks]


def measure(bed: rig.Rig, *, quick: bool, say: rig.Say) -> tuple[Result, str]:
    haproxybed.haproxy_binary()  # fails early, naming the package, when HAProxy is missing
    conversations, agents, turns = (8, 8, 3) if quick else (16, 12, 4)
    result = run(bed, conversations=conversations, agents=agents, turns=turns, say=say)
    return result, table(result) + "\n\n" + "\n".join(verdicts(result))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.nodes", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 conversations and 8 agents', 3 turns (else 16, 12, 4)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "out", help="JSON and logs go here")
    parser.add_argument("--threads", type=int, default=2, help="llama-server -t (default 2)")
    ns = parser.parse_args(argv)
    bed = rig.Rig(log_dir=ns.out / f"logs-nodes-{time.strftime('%Y%m%d-%H%M%S')}", threads=ns.threads)
    try:
        before = rig.busy()
        result, body = measure(bed, quick=ns.quick, say=lambda text: print(text, file=sys.stderr, flush=True))
        print(f"## Nodes\n({before} at start, {rig.busy()} at end)\n")
        print(body)
    finally:
        bed.close()
    (ns.out / "nodes.json").write_text(json.dumps(dataclasses.asdict(result), indent=2))
    return 1 if any(line.startswith("MISSED") for line in verdicts(result)) else 0


if __name__ == "__main__":
    sys.exit(main())
