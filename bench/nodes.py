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
  same turn of the conversations that stayed (no failure for them, same
  node, same sizes; medians);
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
cached and at most 1.5x the time of the turn without a failure, and the
burst's busiest node within the balance factor (1.5x the mean, rounded up
to a whole request). MET or MISSED each, exit status 1
on a miss.

Run alone with ``python -m bench.nodes [--quick]``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
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
SLOTS = 4
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
        """The goal's figure: the median of the moved turns, each over its neighbours that stayed."""
        return statistics.median(self.paired) if self.paired else float("nan")


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


def _paired(sent: list[Chat], moved: list[Chat], turn: int) -> list[float]:
    """Each moved conversation's turn ``turn`` over that of the conversations that stayed sent nearest before and
    after it: the same turn on the same node, side by side in time (what the machine's load does to one does it
    to the other)."""
    ratios = []
    for i, chat in enumerate(sent):
        if chat not in moved:
            continue
        before = [c for c in reversed(sent[:i]) if c not in moved][:1]
        after = [c for c in sent[i + 1 :] if c not in moved][:1]
        if before or after:
            ratios.append(chat.seconds[turn] / statistics.mean(c.seconds[turn] for c in before + after))
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


def _steps(side: Any, since: float) -> tuple[list[dict[str, float]], list[float]]:
    """From ``side``'s log after Unix time ``since``: the steps of each placement served from the shared store
    (tokenize, lookup, download, swap and the whole placement, in seconds), and the other placements' seconds."""

    def after(event: str) -> list[dict[str, Any]]:
        return [e for e in side.log_events(event) if datetime.fromisoformat(e["timestamp"]).timestamp() >= since]

    routed = after("request_routed")
    found = [e for e in after("shared_prefix_found") if e["verdict"] == "fetch"]
    swaps = {e["file"]: float(e["seconds"]) for e in after("conversation_swapped_in")}
    steps = []
    for placed, looked, fetched in zip(
        (e for e in routed if e["source"] == "shared"), found, after("shared_snapshot_fetched"), strict=False
    ):
        steps.append(
            {
                "placement": float(placed["seconds"]),
                "tokenize": float(placed.get("tokenize_seconds", 0.0)),
                "lookup": float(looked["lookup_seconds"]),
                "download": float(fetched["seconds"]),
                "swap": swaps.get(fetched["file"], float("nan")),
            }
        )
    return steps, [float(e["seconds"]) for e in routed if e["source"] != "shared"]


def run(bed: rig.Rig, *, conversations: int, turns: int, say: rig.Say) -> Result:
    s3 = s3bed.S3Server(bed.work / "s3")
    balancers: list[Any] = []
    try:
        s3.start()
        s3.create_bucket(BUCKET)
        store = f"s3://{BUCKET}/nodes-{secrets.token_hex(4)}"
        nodes: dict[str, Node] = {}
        for name in NODES:
            slot_dir = bed.slot_dir(f"nodes-{name}")
            server = bed.server(slot_dir=slot_dir, n_slots=SLOTS, ctx_size=4096, alone=False)
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
        chats: dict[str, list[Chat]] = {}
        for way, balancer, seed in ((ROUND_ROBIN, robin, 600), (SHIPPED, shipped, 450)):
            chats[way] = [
                Chat(n, llamabed.make_prompt(url0, FIRST_TOKENS, seed=seed + n)) for n in range(conversations)
            ]
            for t in range(turns):
                if t:
                    _settle(list(nodes.values()))
                _round(chats[way], balancer.url, nodes, random.Random(t) if t else None)
                say(f"  {way}: turn {t + 1} of {turns} sent by {conversations} conversations")
        mine = chats[SHIPPED]
        dead = nodes[mine[0].nodes[-1]]
        alive = next(node for node in nodes.values() if node is not dead)
        moved = [c for c in mine if c.nodes[-1] == dead.name]
        stayed = [c for c in mine if c.nodes[-1] == alive.name]
        _settle(list(nodes.values()))
        dead.server.kill()
        shipped.wait_status(dead.name, "DOWN", timeout=60)
        killed = time.time()
        sent = _round(mine, shipped.url, nodes, random.Random(turns))
        steps, placing = _steps(alive.side, killed)
        say(f"  after the kill -9 of {dead.name}: {len(moved)} conversations moved, {len(stayed)} stayed")
        return Result(
            conversations,
            turns,
            [_phase(SHIPPED, mine, turns), _phase(ROUND_ROBIN, chats[ROUND_ROBIN], turns)],
            dead.name,
            [c.reused(turns) for c in moved],
            sum(c.fetched[turns] for c in moved),
            [c.seconds[turns] for c in moved],
            [c.seconds[turns] for c in stayed],
            [c.seconds[turns - 1] for c in moved],
            [c.server_seconds[turns] for c in moved],
            [c.server_seconds[turns] for c in stayed],
            steps,
            placing,
            burst,
            balance_factor(),
            _paired(sent, moved, turns),
        )
    finally:
        for balancer in balancers:
            balancer.stop()
        s3.stop()


def _share(part: int, whole: int) -> str:
    return f"{part / whole:.0%} ({part} of {whole})" if whole else "-"


def table(r: Result) -> str:
    head = (
        f"{r.conversations} conversations (two agents, first messages of ~{FIRST_TOKENS:,} tokens), {r.turns} turns "
        f"each through each balancer, on 2 nodes of {SLOTS} slots with one shared S3 store; then kill -9 of "
        f"{r.dead}'s llama-server and one more turn through the shipped config\n\n"
    )
    rows = [
        (p.name, "/".join(str(p.spread[n]) for n in NODES), _share(p.warm, p.returning), p.fetched, p.reused)
        for p in r.phases
    ]
    phases = rig.table(["balancer", "convs per node", "returning turns warm", "fetched", "reused"], rows)
    median = statistics.median
    moved = rig.table(
        ["after kill -9", "conversations", "min reused", "fetched", "median s", "no failure s", "ratios", "ratio"],
        [
            (
                f"{r.dead}'s, moved",
                len(r.moved_reused),
                min(r.moved_reused, default=float("nan")),
                r.moved_fetched,
                median(r.moved_seconds) if r.moved_seconds else float("nan"),
                median(r.stayed_seconds) if r.stayed_seconds else float("nan"),
                " ".join(f"{x:.2f}" for x in sorted(r.paired)),
                r.time_ratio,
            )
        ],
        digits=2,
    )
    nan = float("nan")

    def med(values: list[float]) -> float:
        return median(values) if values else nan

    def step(name: str) -> float:
        return med([s[name] for s in r.moved_steps if name in s])

    placing_moved = step("placement")
    where = rig.table(
        ["after kill -9, medians s", "whole turn", "llama-server", "placement", "tokenize", "lookup", "download",
         "swap", "the rest"],
        [
            (f"{r.dead}'s, moved", med(r.moved_seconds), med(r.moved_server_seconds), placing_moved,
             step("tokenize"), step("lookup"), step("download"), step("swap"),
             med(r.moved_seconds) - med(r.moved_server_seconds) - placing_moved),
            ("stayed", med(r.stayed_seconds), med(r.stayed_server_seconds), med(r.stayed_placing), nan, nan, nan,
             nan, med(r.stayed_seconds) - med(r.stayed_server_seconds) - med(r.stayed_placing)),
        ],
        digits=3,
    )  # fmt: skip
    before = median(r.moved_before_seconds) if r.moved_before_seconds else float("nan")
    tail = (
        f"\n\n'no failure s': the same turn of the {len(r.stayed_seconds)} conversations that stayed on their node; "
        "'ratios': each moved turn over the turns that stayed sent just before and after it (the same turn, side by "
        "side in time), 'ratio' their median (the goal's figure); "
        f"the moved ones' turn before the kill took {before:.2f} s (median)"
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
    checks = [
        (warm >= WARM_GOAL, f"returning turns warm with the shipped config at least {WARM_GOAL:.0%}",
         f"{warm:.1%} (round robin {robin.warm / robin.returning:.1%})"),
        (bool(r.moved_reused) and min(r.moved_reused) >= CACHED_GOAL,
         f"the dead node's conversations at least {CACHED_GOAL:.0%} cached on their next turn",
         ", ".join(f"{x:.1%}" for x in r.moved_reused) or "none moved"),
        (r.time_ratio <= TIME_GOAL, f"their next turn at most {TIME_GOAL}x the same turn without a failure",
         f"{r.time_ratio:.2f}x"),
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
    conversations, turns = (8, 3) if quick else (16, 4)
    result = run(bed, conversations=conversations, turns=turns, say=say)
    return result, table(result) + "\n\n" + "\n".join(verdicts(result))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.nodes", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 conversations, 3 turns each (else 16, 4)")
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
