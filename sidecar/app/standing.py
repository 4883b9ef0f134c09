"""What this node tells a load balancer about itself: pure, from one :class:`report.Status`.

Invariants and trade-offs: docs/modules.md, `sidecar/app/standing.py`.
"""

from __future__ import annotations

import dataclasses

from sidecar.core import events, outcomes
from sidecar.engine import lifecycle, report

FULL = 100
"""The weight, in percent of the server line's ``weight``, while a slot is free."""
SATURATED = 50
"""The weight while every slot is processing a request."""


@dataclasses.dataclass(frozen=True, slots=True)
class Facts:
    """What the decision needs to know of the node, read from its status."""

    server: events.Health | None
    """llama-server's health at the newest poll; None before the first."""
    denied: bool = False
    """llama-server refuses the sidecar's reads (a missing or wrong API key)."""
    restore_gate: str = ""
    """Why the restore gate is closed; "" while it is open."""
    low_disk: bool = False
    slots: int = 0
    """Slots the newest /slots read listed (0: not read)."""
    busy: int = 0
    """Of those, slots processing a request."""
    held: int = 0
    """Of those, slots holding a conversation's tokens."""
    restoring: tuple[str, ...] = ()
    """Router mode: the loaded models whose restore round is owed or running (their own gates closed)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Answer:
    state: outcomes.AgentState
    weight: int
    """Percent of the configured weight; meaningful only for ``up``."""
    why: str
    """Said after ``#`` on the line: HAProxy logs it with a change of state."""

    def line(self) -> bytes:
        """The agent-check reply, one line of ASCII ending in ``\\n``."""
        if self.state is outcomes.AgentState.DOWN:
            words = "down"
        elif self.state is outcomes.AgentState.DRAIN:
            words = "up drain"
        else:
            words = f"ready up {self.weight}%"
        why = self.why.encode("ascii", "replace").decode().replace("\n", " ").replace("#", "")
        return f"{words} #{why}\n".encode()


def facts(status: report.Status) -> Facts:
    """The facts of one status: the newest poll, the restore gate, the newest save's free-space check; in router
    mode, the router's health with every loaded model's slots and restore gate."""
    latest = status.observation
    loaded = [(name, model) for name, model in status.models if _health(model) is events.Health.OK]
    slots = tuple(v for _, model in loaded for v in _slots(model)) if status.models else _slots(status)
    return Facts(
        server=latest.health if latest is not None else None,
        denied=bool(latest.denied) if latest is not None else False,
        restore_gate=status.restore_gate,
        low_disk=status.low_disk,
        slots=len(slots),
        busy=sum(1 for s in slots if s.processing),
        held=sum(1 for s in slots if not s.empty),
        restoring=tuple(name for name, model in loaded if model.restore_gate),
    )


def _health(status: report.Status) -> events.Health | None:
    return status.observation.health if status.observation is not None else None


def _slots(status: report.Status) -> tuple[events.SlotView, ...]:
    return (status.observation.slots or ()) if status.observation is not None else ()


def answer(known: Facts) -> Answer:
    """The agent-check answer for ``known``: down, drain, or up with a weight (see the module docstring)."""
    if known.server is None:
        return Answer(outcomes.AgentState.DOWN, 0, "the sidecar has not polled llama-server yet")
    if known.server is not events.Health.OK:
        return Answer(outcomes.AgentState.DOWN, 0, f"llama-server is {known.server.value}")
    if known.denied:
        return Answer(outcomes.AgentState.DOWN, 0, "llama-server refuses the sidecar's API key")
    if known.restore_gate:
        return Answer(outcomes.AgentState.DRAIN, 0, lifecycle.problem(known.restore_gate))
    if known.low_disk:
        return Answer(outcomes.AgentState.DRAIN, 0, "slot dir below --min-free-bytes: new conversations not saved")
    free = known.slots - known.busy
    weight = SATURATED if known.slots and free <= 0 else FULL
    why = f"{free} of {known.slots} slots free, {known.held} holding a conversation"
    if known.restoring:
        why = f"restoring model {', '.join(known.restoring)} (its requests wait here); {why}"
    return Answer(outcomes.AgentState.UP, weight, why)
