"""Two nodes behind the real HAProxy with the shipped config: each conversation stays where its KV is.

Two llama-servers, two sidecars (proxy, agent check, one shared S3 store: a
real SeaweedFS) and HAProxy (Debian's package) on loopback ports. Eight
conversations of two agents (two system prompts) go through HAProxy; each
turn's node is read from the ``x-node`` header the bed adds, and what it
reused from the answer's ``timings.cache_n``. Then node A's llama-server is
``kill -9``ed: its conversations must continue on node B, warm from the
shared store; and once A is back, they must return to A warm, not cold.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sidecar.shared import catalog
from tests.support import nodechats
from tests.support.haproxybed import HAProxy
from tests.support.llamabed import LlamaServer, MakeServer, make_prompt
from tests.support.net import free_port
from tests.support.nodechats import Chat
from tests.support.s3bed import S3Server
from tests.support.sidecarbed import MakeSidecar, SidecarProcess

FIRST_TOKENS = 1500
"""A first message long enough that fetching its snapshot beats prefilling it (see test_shared_nodes)."""
CONVERSATIONS = 8
WARM = 0.9
"""Share of the previous turn's prompt a returning turn must reuse to count as warm."""


class Node:
    def __init__(self, name: str, server: LlamaServer, side: SidecarProcess) -> None:
        self.name, self.server, self.side = name, server, side

    def settled(self) -> bool:
        return nodechats.settled(self.side)


def warm(chat: Chat, turn: int) -> bool:
    """Turn ``turn`` (0-based) reused at least :data:`WARM` of the turn before's prompt."""
    return chat.reused(turn) >= WARM


@pytest.fixture
def nodes(
    llama: MakeServer, sidecar: MakeSidecar, s3_server: S3Server, s3_url: str, tmp_path: Path
) -> Iterator[tuple[Node, Node, HAProxy]]:
    made = {}
    for name in ("node-a", "node-b"):
        slot_dir = tmp_path / name
        slot_dir.mkdir()
        server = llama(slot_dir=slot_dir, n_slots=4, ctx_size=4096)
        proxy, agent = free_port(), free_port()
        side = sidecar(
            server,
            slot_dir,
            extra={
                "--proxy-listen": f"127.0.0.1:{proxy}",
                "--agent-check-listen": f"127.0.0.1:{agent}",
                "--shared-store": s3_url,
            },
            env=s3_server.env(),
        )
        made[name] = (Node(name, server, side), proxy, agent)
    with HAProxy(tmp_path, {name: (proxy, agent) for name, (_, proxy, agent) in made.items()}) as balancer:
        for name in made:
            balancer.wait_status(name, "UP", timeout=60)
        yield made["node-a"][0], made["node-b"][0], balancer


def _settle(*nodes: Node) -> None:
    """Wait until each node has saved and uploaded what it serves, then until every node's listing of the
    store is older than that (a node reuses a listing for ``catalog.REFRESH_EVERY``)."""
    for node in nodes:
        node.side.wait_for(node.settled, timeout=120, what=f"{node.name}'s slots saved and uploaded")
    done = time.monotonic()
    nodes[0].side.wait_for(
        lambda: time.monotonic() - done >= catalog.REFRESH_EVERY,
        timeout=catalog.REFRESH_EVERY + 5,
        what="the nodes' listings of the store to expire",
    )


def test_conversations_stay_on_their_node_move_warm_when_it_dies_and_come_back_warm(
    nodes: tuple[Node, Node, HAProxy], figure: Callable[[str], None]
) -> None:
    node_a, node_b, balancer = nodes
    chats = [Chat(n, make_prompt(node_a.server.url, FIRST_TOKENS, seed=450 + n)) for n in range(CONVERSATIONS)]
    for chat in chats:
        chat.turn(balancer.url)
    _settle(node_a, node_b)
    for chat in chats:
        chat.turn(balancer.url)
    spread = {name: sum(c.nodes[0] == name for c in chats) for name in ("node-a", "node-b")}
    assert all(c.nodes[1] == c.nodes[0] for c in chats), [c.nodes for c in chats]
    assert all(warm(c, 1) for c in chats), [(c.cached, c.prompts) for c in chats]
    assert min(spread.values()) >= 1, spread  # both nodes serve: the hash spreads conversations

    # kill -9 the llama-server of the node holding conversation 0; its agent says down
    dead = node_a if chats[0].nodes[0] == "node-a" else node_b
    alive = node_b if dead is node_a else node_a
    moved = [c for c in chats if c.nodes[0] == dead.name]
    stayed = [c for c in chats if c.nodes[0] == alive.name]
    _settle(node_a, node_b)
    fetched_before = alive.side.metric("llama_sidecar_conversation_requests_total", source="shared")
    dead.server.kill()
    balancer.wait_status(dead.name, "DOWN", timeout=30)
    for chat in chats:
        chat.turn(balancer.url)
    assert all(c.nodes[2] == alive.name for c in chats), [c.nodes for c in chats]
    assert all(warm(c, 2) for c in moved), [(c.cached, c.prompts) for c in moved]
    assert all(warm(c, 2) for c in stayed), [(c.cached, c.prompts) for c in stayed]
    fetched = alive.side.metric("llama_sidecar_conversation_requests_total", source="shared") - fetched_before
    assert fetched == len(moved), (fetched, len(moved))

    # the node comes back: draining while its restore round runs, then up; its conversations return warm
    _settle(alive)
    dead.server.start()
    dead.server.wait_healthy()
    balancer.wait_status(dead.name, "UP", timeout=120)
    dead.side.wait_for(lambda: dead.side.get("/readyz")[0] == 200, timeout=60, what="the node ready")
    for chat in chats:
        chat.turn(balancer.url)
    assert all(c.nodes[3] == c.nodes[0] for c in chats), [c.nodes for c in chats]
    assert all(warm(c, 3) for c in chats), [(c.cached, c.prompts) for c in chats]

    def share(group: list[Chat], turn: int) -> str:
        return f"{sum(c.cached[turn] for c in group) / sum(c.prompts[turn - 1] for c in group):.2f}"

    slow = max(c.seconds[2] / c.seconds[1] for c in moved)
    figure(
        f"8 conversations through HAProxy, spread {spread}; turn 2 on the same node warm: {share(chats, 1)} of the"
        f" prompt reused; after kill -9 of {dead.name}: its {len(moved)} moved to {alive.name}, reused"
        f" {share(moved, 2)} ({fetched:.0f} fetched from S3), slowest at {slow:.2f}x its turn before;"
        f" back on {dead.name}: reused {share(moved, 3)}"
    )
