"""One proxied request's admission, from the restore gate to its release: its stage and the rules that move it. Pure.

A ``Ticket`` per request moves through ``Stage`` (held, placing, placed, forwarded, relaying,
released) by the rules kept here; a move they do not allow raises ``IllegalMove``.

Invariants and trade-offs: docs/modules.md, `sidecar/proxy/tickets.py`.
"""

from __future__ import annotations

import enum
import math


class Stage(enum.StrEnum):
    HELD = "held"
    """At the restore gate: it waits there while the gate is closed to it."""
    PLACING = "placing"
    """Let through; the library is choosing its slot (and may have reserved it for a swap)."""
    PLACED = "placed"
    """Pinned to its slot (``slot``), or placed as it came (``slot`` None); not yet sent."""
    FORWARDED = "forwarded"
    """Sent to llama-server, no byte of the answer relayed yet: it may be sent again."""
    RELAYING = "relaying"
    """The answer's first event came: relayed as it arrives, never sent again."""
    RELEASED = "released"
    """Ended: answered, refused, held too long or cancelled."""


class Move(enum.StrEnum):
    """What happens to a request, as :func:`after` reads it."""

    LET_THROUGH = "let_through"
    """The gate lets a routed request on: the library places it."""
    RESERVE = "reserve"
    """The library reserved a slot for it (pinned: that slot counts busy)."""
    UNRESERVE = "unreserve"
    """The library let its slot go before placing it (a swap failed: it goes as it came)."""
    PLACE = "place"
    """The library's placement is done: the request is ready to be sent."""
    LATER = "later"
    """Let through before the restore round ended, but no restored slot holds its prefix: it waits for the round."""
    SEND = "send"
    """Sent to llama-server (once more, after a lost connection or a wait)."""
    CLOSED = "closed"
    """The gate closed before the answer began: a routed request is placed again, any other waits."""
    FIRST_EVENT = "first_event"
    """The answer's first event came."""
    RELEASE = "release"
    """The request ended."""


class Resume(enum.StrEnum):
    """How a request whose gate closed before its answer began goes on."""

    WAIT = "wait"
    """Wait at the gate, then send it again as it is."""
    REPLACE = "replace"
    """Leave its placement, wait at the gate, then have the library place it again."""


class Replay(enum.StrEnum):
    """What follows a connection llama-server closed before the answer's first event."""

    RESEND = "resend"
    """Send it once more at once (after a crash that attempt finds nothing listening and waits at the gate)."""
    SUSPECT = "suspect"
    """The second such loss: the gate is closed on suspicion, and the request sent once the server is back."""
    GIVE_UP = "give_up"
    """Sent as often as it may be: the client gets an error."""


class IllegalMove(Exception):
    """A move the rules do not allow from the ticket's stage: a bug in the caller, never a request's fault."""


_SENT: dict[tuple[Stage, Move], Stage] = {
    (Stage.FORWARDED, Move.SEND): Stage.FORWARDED,
    (Stage.FORWARDED, Move.CLOSED): Stage.HELD,
    (Stage.FORWARDED, Move.FIRST_EVENT): Stage.RELAYING,
    (Stage.HELD, Move.CLOSED): Stage.HELD,
    **{(stage, Move.RELEASE): Stage.RELEASED for stage in Stage if stage is not Stage.RELEASED},
}
"""The moves of any request once it may be sent."""
_ROUTED: dict[tuple[Stage, Move], Stage] = {
    (Stage.HELD, Move.LET_THROUGH): Stage.PLACING,
    (Stage.PLACING, Move.RESERVE): Stage.PLACING,
    (Stage.PLACING, Move.UNRESERVE): Stage.PLACING,
    (Stage.PLACING, Move.PLACE): Stage.PLACED,
    (Stage.PLACING, Move.LATER): Stage.HELD,
    (Stage.PLACED, Move.SEND): Stage.FORWARDED,
    (Stage.PLACED, Move.CLOSED): Stage.HELD,
    **_SENT,
}
"""A request the library places: (stage, move) -> the stage it leads to."""
_PLAIN: dict[tuple[Stage, Move], Stage] = {(Stage.HELD, Move.SEND): Stage.FORWARDED, **_SENT}
"""Any other request: sent straight from the gate."""


def after(stage: Stage, move: Move, *, routed: bool) -> Stage:
    """The stage ``move`` leads to from ``stage``; :class:`IllegalMove` if the rules do not allow it.

    ``routed``: the library places the request (a placement comes between the gate and the send).
    """
    target = (_ROUTED if routed else _PLAIN).get((stage, move))
    if target is None:
        raise IllegalMove(f"{move.value} from {stage.value} ({'routed' if routed else 'not routed'})")
    return target


def replay(replays: int, *, gated: bool) -> Replay:
    """What follows the ``replays``-th connection lost before the first event (counted from 1).

    ``gated``: the request waits at the restore gate (a completion), so it may be sent once more after a restart.
    """
    if replays > (2 if gated else 1):
        return Replay.GIVE_UP
    return Replay.SUSPECT if replays == 2 else Replay.RESEND


class Ticket:
    """One request's admission: where it is (:attr:`stage`), the slot it holds, its deadline at the gate.

    Its public face is what the proxy and the library read (:attr:`deadline`, :attr:`stage`,
    :attr:`slot`, :attr:`within`, :attr:`prepares`) and the moves they make; how it was made
    (routed, gated) and what it counts (replays, a wait for the whole round) stay inside.
    Compared and hashed by identity: a live set of tickets holds each request once."""

    __slots__ = ("_gated", "_replays", "_routed", "_whole_round", "deadline", "slot", "stage", "within")

    def __init__(self, deadline: float = math.inf, *, routed: bool = True, gated: bool = True) -> None:
        """``routed``: the library places it (a completion, with the library on). ``gated``: it waits at the
        restore gate (a completion), so a lost connection may be sent once more after a restart."""
        self.deadline = deadline
        """Monotonic time after which it waits no more at the gate (``--proxy-hold-seconds`` after it arrived)."""
        self._routed = routed
        self._gated = gated
        self.stage = Stage.HELD
        self.slot: int | None = None
        """The slot the library reserved or pinned it to, while it holds it; None otherwise."""
        self.within: frozenset[int] | None = None
        """The slots restored so far by the restore round that let it through early (:mod:`sidecar.restore.early`);
        None: let through by an open gate."""
        self._whole_round = False
        """Let through early but placed only after the whole restore round (:attr:`Move.LATER`)."""
        self._replays = 0
        """Connections llama-server closed before the answer's first event."""

    def __repr__(self) -> str:
        return f"Ticket(stage={self.stage.value}, slot={self.slot}, within={self.within}, routed={self._routed})"

    def _move(self, move: Move) -> None:
        self.stage = after(self.stage, move, routed=self._routed)

    def let_through(self, within: frozenset[int] | None) -> None:
        """The gate lets it on (``within``: the restored slots, if a running round let it through early)."""
        self._move(Move.LET_THROUGH)
        self.within = within

    def reserve(self, slot: int) -> None:
        """The library holds ``slot`` for it: that slot counts busy while the ticket is live."""
        self._move(Move.RESERVE)
        if self.slot is not None:
            raise IllegalMove(f"reserve slot {slot} while slot {self.slot} is reserved")
        self.slot = slot

    def unreserve(self) -> None:
        """The library let its slot go (or had none): it is placed as it came."""
        self._move(Move.UNRESERVE)
        self.slot = None

    def place(self) -> None:
        """The placement is done; the request is sent next."""
        self._move(Move.PLACE)
        self._whole_round = False

    def later(self) -> None:
        """Let through early, it waits for the whole restore round now."""
        if self.slot is not None:
            raise IllegalMove(f"later while slot {self.slot} is reserved")
        self._move(Move.LATER)
        self._whole_round = True
        self.within = None

    def send(self) -> None:
        self._move(Move.SEND)

    def closed(self) -> Resume:
        """The gate closed before the answer began: how the request goes on. It holds no slot from now on."""
        self._move(Move.CLOSED)
        self.slot = None
        self.within = None
        return Resume.REPLACE if self._routed else Resume.WAIT

    def lost(self) -> Replay:
        """llama-server closed the connection before the answer's first event (the request stays sent)."""
        if self.stage is not Stage.FORWARDED:
            raise IllegalMove(f"lost from {self.stage.value}")
        self._replays += 1
        return replay(self._replays, gated=self._gated)

    def first_event(self) -> None:
        self._move(Move.FIRST_EVENT)

    def release(self) -> None:
        """The request ended: it holds nothing any more."""
        self._move(Move.RELEASE)
        self.slot = None
        self.within = None

    @property
    def prepares(self) -> bool:
        """Whether it reads its token ids while it waits at the gate (not once it waits for the whole round)."""
        return self._routed and not self._whole_round
