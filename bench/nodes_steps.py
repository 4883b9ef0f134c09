"""The nodes section's steps: the nodes, the balancer's configs, a round of turns, the burst, and what a kill -9
moved (the turns paired with their neighbours, the placement's steps from the surviving node's log).
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import random
import re
import statistics
import time
import urllib.request
from collections.abc import Callable
from datetime import datetime
from typing import Any

from bench import rig
from bench.beds import haproxybed, llamabed, nodechats
from bench.nodes_result import (
    AGENT_FIRST_TOKENS,
    AGENT_SYSTEM_TOKENS,
    ANSWER_TOKENS,
    LISTING_EXPIRES,
    NODES,
    TOOL_TOKENS,
    WARM,
    Kill,
    Phase,
)


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


def burst(url: str, n: int) -> dict[str, int]:
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


def ready(side: Any) -> Callable[[], bool]:
    return lambda: bool(side.get("/readyz")[0] == 200)


def settle(nodes: list[Node]) -> None:
    for node in nodes:
        node.side.wait_for(node.settled, timeout=300, what=f"{node.name}'s slots saved and uploaded")
    time.sleep(LISTING_EXPIRES + 0.5)


def take_round(chats: list[Chat], url: str, nodes: dict[str, Node], order: random.Random | None) -> list[Chat]:
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


def phase(name: str, chats: list[Chat], turns: int) -> Phase:
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


def placement_steps(side: Any, since: float) -> list[dict[str, float]]:
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


def kill(sent: list[Chat], kind: list[Chat], dead: str, turn: int, steps: list[dict[str, float]]) -> Kill:
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
