"""Where one watched llama-server is in its life, as one state machine: pure, no I/O.

``step(life, observation)`` is the only move, looked up in tables; the restore gate holds the one
``Life`` of its server and the rest reads its answers off it. An opening is refused while a
suspicion awaits a newer poll or a restore round is owed or running.

Invariants and trade-offs: docs/modules.md, `sidecar/engine/lifecycle.py`.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import ClassVar, Final

from sidecar.core import events

NOT_POLLED = "the sidecar has not seen llama-server up yet"
OWED = "a restore round is owed: llama-server lost its slots (restart or wake-up)"


class Stage(enum.StrEnum):
    """Where the server is, as the restore gate sees it: open only in :attr:`SERVING`."""

    UNSEEN = "unseen"
    """The sidecar has not seen it up yet (its start)."""
    DOWN = "down"
    """A poll found it unreachable, failing, or not running the model (router mode)."""
    LOADING = "loading"
    """A poll found it loading its model (or the router loads it for a request)."""
    SUSPECT = "suspect"
    """The proxy or the launcher saw it fail: closed until a poll that started after that sees it up."""
    RESTORING = "restoring"
    """It answers, and lost its slots: closed for a restore round (held requests may read their ids)."""
    SERVING = "serving"
    """Open: requests go on."""


class Round(enum.StrEnum):
    """Where the restore round of the server process stands."""

    OWED = "owed"
    """At start-up, after each restart or wake-up, and after a round the server did not answer."""
    RUNNING = "running"
    DONE = "done"
    """Done, or nothing to restore: requests no longer race it."""


class Kind(enum.StrEnum):
    """What was observed: the columns of the transition tables."""

    DOWN = "down"
    LOADING = "loading"
    SUSPECTED = "suspected"
    EMPTIED = "emptied"
    ANSWERS = "answers"
    READY = "ready"
    ROUND_STARTED = "round_started"
    ROUND_ENDED = "round_ended"
    ROUND_UNANSWERED = "round_unanswered"


# ---- the observations -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Unhealthy:
    """A poll found the server not ok (``health`` is not ``OK``); ``reason``: said instead of the health."""

    health: events.Health
    reason: str | None = None

    @property
    def kind(self) -> Kind:
        return Kind.LOADING if self.health is events.Health.LOADING else Kind.DOWN

    def said(self) -> str:
        return self.reason if self.reason is not None else f"llama-server is {self.health.value}"


@dataclasses.dataclass(frozen=True, slots=True)
class Suspected:
    """The proxy could not reach the server, or the launcher's child exited, at monotonic ``at``."""

    at: float
    reason: str
    kind: ClassVar[Kind] = Kind.SUSPECTED


@dataclasses.dataclass(frozen=True, slots=True)
class Emptied:
    """The server lost every slot's KV (a new process, or a wake-up): a restore round is owed."""

    reason: str = OWED
    kind: ClassVar[Kind] = Kind.EMPTIED


@dataclasses.dataclass(frozen=True, slots=True)
class Up:
    """A poll that started at monotonic ``at`` saw the server up; ``ready``: its slots and identity were read
    and it is awake (the sidecar may restore into it), else nothing can be restored into it now."""

    at: float
    ready: bool

    @property
    def kind(self) -> Kind:
        return Kind.READY if self.ready else Kind.ANSWERS


@dataclasses.dataclass(frozen=True, slots=True)
class RoundStarted:
    """The action runner started the restore round."""

    kind: ClassVar[Kind] = Kind.ROUND_STARTED


@dataclasses.dataclass(frozen=True, slots=True)
class RoundEnded:
    """The restore round ended; ``answered`` False: the server did not answer /slots, the round is owed again."""

    answered: bool = True

    @property
    def kind(self) -> Kind:
        return Kind.ROUND_ENDED if self.answered else Kind.ROUND_UNANSWERED


Observation = Unhealthy | Suspected | Emptied | Up | RoundStarted | RoundEnded


# ---- the tables ------------------------------------------------------------------------------

_FROM_ANY: Final[Mapping[Kind, Stage]] = {
    Kind.DOWN: Stage.DOWN,
    Kind.LOADING: Stage.LOADING,
    Kind.SUSPECTED: Stage.SUSPECT,
    Kind.EMPTIED: Stage.RESTORING,
    Kind.ANSWERS: Stage.SERVING,
    Kind.READY: Stage.SERVING,
}
"""Observations that move the gate to the same stage from every stage."""
CLOSING: Final[frozenset[Kind]] = frozenset({Kind.DOWN, Kind.LOADING, Kind.SUSPECTED, Kind.EMPTIED})
"""Observations that close the gate (the gate logs ``restore_gate_closed`` when its reason changes)."""

GATE: Final[Mapping[tuple[Stage, Kind], Stage]] = {
    (stage, kind): _FROM_ANY.get(kind, stage) for stage in Stage for kind in Kind
}
"""(stage, observation) → next stage, before the guards (see the module docstring). The round's own
observations leave the stage as it is: a poll opens the gate once the round is done."""

ROUND: Final[Mapping[tuple[Round, Kind], Round]] = {
    **{(state, kind): state for state in Round for kind in Kind},
    **{(state, Kind.EMPTIED): Round.OWED for state in Round},
    **{(state, Kind.ROUND_STARTED): Round.RUNNING for state in Round},
    **{(state, Kind.ROUND_UNANSWERED): Round.OWED for state in Round},
    (Round.RUNNING, Kind.ROUND_ENDED): Round.DONE,
}
"""(round, observation) → next round. A round that ends after the server lost its slots again meanwhile
(owed anew) stays owed."""

WAITS_FOR_ROUND: Final[frozenset[Kind]] = frozenset({Kind.READY})
"""Observations that open the gate only while no restore round is owed or running."""


@dataclasses.dataclass(frozen=True, slots=True)
class Life:
    """Where one watched server is in its life; moved only by :func:`step`."""

    stage: Stage = Stage.UNSEEN
    round: Round = Round.OWED
    reason: str = NOT_POLLED
    """Why the gate last closed (kept once it opens: its open log line says what it was)."""
    suspect_at: float | None = None
    """When the newest suspicion not yet cleared was raised (monotonic); None: none."""

    @property
    def open(self) -> bool:
        """Whether requests may reach the server."""
        return self.stage is Stage.SERVING

    @property
    def restoring(self) -> bool:
        """Whether the gate is closed for a restore round while the server answers (only its slots are not ready)."""
        return self.stage is Stage.RESTORING

    @property
    def closed_because(self) -> str:
        """Why the gate is closed; "" while it is open."""
        return "" if self.open else self.reason

    @property
    def restore_owed(self) -> bool:
        """Whether a restore round is owed or running: requests that reach the server now may race it."""
        return self.round is not Round.DONE


START: Final = Life()
"""A server the sidecar has not polled yet: closed, a restore round owed (the sidecar's own start)."""


def step(life: Life, seen: Observation) -> Life:
    """The life after ``seen``: the tables say where to, the guards may refuse an opening."""
    kind = seen.kind
    moved = dataclasses.replace(life, stage=GATE[life.stage, kind], round=ROUND[life.round, kind])
    match seen:
        case Up(at=at) if moved.open:
            if life.suspect_at is not None and at <= life.suspect_at:
                return life  # a poll in flight when the suspicion came saw the old process
            if kind in WAITS_FOR_ROUND and moved.round is not Round.DONE:
                return life  # the action runner opens it once the round is done
            return dataclasses.replace(moved, suspect_at=None)
        case Unhealthy():
            return dataclasses.replace(moved, reason=seen.said())
        case Suspected(at=at, reason=reason):
            return dataclasses.replace(moved, reason=reason, suspect_at=at)
        case Emptied(reason=reason):
            return dataclasses.replace(moved, reason=reason)
    return moved


def problem(reason: str) -> str:
    """What ``/readyz``, the page and the agent check say of a gate closed for ``reason`` ("" while open)."""
    return f"restore gate closed: {reason}" if reason else ""
