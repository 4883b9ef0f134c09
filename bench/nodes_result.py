"""The nodes section's setup, goals and records: what a run of :mod:`bench.nodes` returns, and what it is judged by."""

from __future__ import annotations

import dataclasses
import math
import statistics

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
    """Each moved turn over the turns that stayed sent just before and after it (:func:`bench.nodes_steps._paired`)."""
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
