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
import dataclasses
import json
import random
import secrets
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench import REPO_ROOT, nodes_steps, rig
from bench.beds import haproxybed, llamabed, net, s3bed
from bench.nodes_result import (
    AGENT_FIRST_TOKENS,
    AGENT_SYSTEM_TOKENS,
    ANSWER_TOKENS,
    BUCKET,
    CACHED_GOAL,
    CTX,
    FIRST_TOKENS,
    NODES,
    ROUND_ROBIN,
    SHIPPED,
    SLOTS,
    TIME_GOAL,
    TOOL_TOKENS,
    WARM_GOAL,
    Kill,
    Result,
)
from bench.nodes_steps import BURST, Chat, Node, agent_chats, balance_factor, round_robin


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
            side.wait_for(nodes_steps.ready(side), timeout=120, what=f"{name} ready")
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
        burst = nodes_steps.burst(shipped.url, BURST)
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
                    nodes_steps.settle(list(nodes.values()))
                nodes_steps.take_round(both, balancer.url, nodes, random.Random(t) if t else None)
                say(f"  {way}: turn {t + 1} of {turns} sent by {len(both)} conversations")
        mine = chats[SHIPPED]
        dead = nodes[mine[0].nodes[-1]]
        alive = next(node for node in nodes.values() if node is not dead)
        nodes_steps.settle(list(nodes.values()))
        dead.server.kill()
        shipped.wait_status(dead.name, "DOWN", timeout=60)
        killed, load = time.time(), rig.busy()
        sent = nodes_steps.take_round(mine + coding, shipped.url, nodes, random.Random(turns))
        steps = nodes_steps.placement_steps(alive.side, killed)
        if len(steps) != len(sent):
            say(f"  {alive.name} logged {len(steps)} placements for {len(sent)} turns: no steps per turn")
        brief, agentic = (nodes_steps.kill(sent, kind, dead.name, turns, steps) for kind in (mine, coding))
        say(
            f"  after the kill -9 of {dead.name}: {len(brief.moved_seconds)} conversations and "
            f"{len(agentic.moved_seconds)} agents' moved, {len(brief.stayed_seconds)} and "
            f"{len(agentic.stayed_seconds)} stayed"
        )
        return Result(
            conversations,
            turns,
            [nodes_steps.phase(SHIPPED, mine, turns), nodes_steps.phase(ROUND_ROBIN, chats[ROUND_ROBIN], turns)],
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
