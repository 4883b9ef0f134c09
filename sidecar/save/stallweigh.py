"""Whether a due save past its hold is worth the stall it costs every slot: a pure decision.

A save runs on llama-server's main loop: every slot waits while the server
writes the whole slot, though only the tail since the slot's last snapshot
is new. What the save protects is that tail: after a crash the server would
re-prefill it. So once a background save has been held its
``--save-hold-seconds`` while another slot generates, it is made only when
the tail's re-prefill (its tokens at the server's measured prefill rate)
costs at least the save's expected stall (the slot's tokens at the seconds
per token of the last save, as the server timed it), or more than
``--max-unsaved-seconds``; otherwise it keeps waiting for a moment when no
other slot is processing. A crash then loses at most a tail that re-prefills
faster than the save would have stalled, and never more than that bound.

Without both figures (no save or not enough prefill measured yet), or with
the bound 0, the save is made once its hold runs out.
"""

from __future__ import annotations

import dataclasses
import enum


class Weight(enum.StrEnum):
    """What the weighing of one save found."""

    UNMEASURED = "unmeasured"
    """No prefill rate or no save time measured yet: saved, as without the weighing."""
    OFF = "off"
    """``--max-unsaved-seconds`` 0: every save is made once its hold runs out."""
    OVER_BOUND = "over_bound"
    """The tail re-prefills slower than ``--max-unsaved-seconds``: saved."""
    WORTH_ITS_STALL = "worth_its_stall"
    """The tail re-prefills at least as slowly as the save stalls every slot: saved."""
    CHEAPER_THAN_STALL = "cheaper_than_stall"
    """The tail re-prefills faster than the save would stall every slot: held."""


@dataclasses.dataclass(frozen=True, slots=True)
class Weighing:
    weight: Weight
    reprefill: float | None
    """Seconds the server would take to re-prefill the unsaved tail; None without a measured rate."""
    stall: float | None
    """Seconds a save of the whole slot is expected to stall every slot; None before a save was measured."""

    @property
    def save(self) -> bool:
        return self.weight is not Weight.CHEAPER_THAN_STALL


def reprefill_seconds(tail: int, rate: float | None) -> float | None:
    """Seconds to re-prefill ``tail`` tokens at ``rate`` tokens per second; None without a rate."""
    return max(tail, 0) / rate if rate else None


def stall_seconds(tokens: int, pace: float | None) -> float | None:
    """Seconds a save of a slot holding ``tokens`` stalls the server, at ``pace`` seconds per token."""
    return max(tokens, 0) * pace if pace is not None else None


def weigh(*, tokens: int, tail: int, rate: float | None, pace: float | None, bound: float) -> Weighing:
    """Weigh a save of a slot holding ``tokens``, ``tail`` of them past its last snapshot.

    ``rate``: the server's measured prefill rate, tokens per second; ``pace``: seconds per token of
    the last save, as the server timed it; ``bound``: ``--max-unsaved-seconds``.
    """
    reprefill, stall = reprefill_seconds(tail, rate), stall_seconds(tokens, pace)
    if bound <= 0:
        weight = Weight.OFF
    elif reprefill is None or stall is None:
        weight = Weight.UNMEASURED
    elif reprefill > bound:
        weight = Weight.OVER_BOUND
    elif reprefill >= stall:
        weight = Weight.WORTH_ITS_STALL
    else:
        weight = Weight.CHEAPER_THAN_STALL
    return Weighing(weight, reprefill, stall)
