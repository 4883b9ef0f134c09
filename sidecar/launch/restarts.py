"""Whether, and when, the launcher starts llama-server again after it ended on its own. Pure code.

A server that has served (the restore gate opened while it ran) is never given up on: a host's
OOM killer may take it every few seconds, and each run it gets back is a run that serves its
conversations warm. It is started again at once after a lone end, and after ends close together
with a delay that doubles up to :data:`MAX_DELAY` (as Kubernetes' CrashLoopBackOff does), until a
run stays up :data:`RESET_SECONDS`. A server that has never served cannot come up: an end by its
own doing (a bad argument, a missing model, a port taken: an exit status, an abort) before it ever
served ends the sidecar, naming the cause, as the server alone would have ended; a ``SIGKILL``
(someone's, or the OOM killer's) is given :data:`CRASH_LOOP_EXITS` tries first.

Invariants and trade-offs: docs/modules.md, `sidecar/launch/restarts.py`.
"""

from __future__ import annotations

import dataclasses
import enum

CRASH_LOOP_EXITS = 5
"""Runs in a row that end before serving: a crash loop (said once; given up on if none ever served)."""
RESET_SECONDS = 60.0
"""A run that stayed up this long ends the backoff: the next end restarts at once."""
FIRST_DELAY = 0.25
"""Seconds before the second restart of a backoff (before jitter); the first is at once."""
MAX_DELAY = 10.0
"""The longest wait between two starts, in seconds (before jitter)."""


class Step(enum.StrEnum):
    RESTART = "restart"
    """Start it again after the verdict's delay."""
    END = "end"
    """It never served and cannot come up: the sidecar ends with its cause."""


@dataclasses.dataclass(frozen=True, slots=True)
class Run:
    """How one run of llama-server went."""

    ran: float
    """Seconds from its start to its end."""
    served: bool
    """The restore gate opened while it ran: it came up and served."""
    killed: bool = False
    """It ended by ``SIGKILL``: not its own doing (the OOM killer, or someone's ``kill -9``)."""


@dataclasses.dataclass(frozen=True, slots=True)
class History:
    """What the launcher keeps of the runs so far: bounded, whatever their number."""

    runs: int = 0
    served: bool = False
    """Some run served."""
    short: int = 0
    """Runs in a row, the newest included, that ended before :data:`RESET_SECONDS`."""
    unserved: int = 0
    """Runs in a row, the newest included, that ended before serving."""

    @property
    def looping(self) -> bool:
        """The last :data:`CRASH_LOOP_EXITS` runs all ended before serving."""
        return self.unserved >= CRASH_LOOP_EXITS


def after(history: History, run: Run) -> History:
    """``history`` once ``run`` has ended."""
    return History(
        runs=history.runs + 1,
        served=history.served or run.served,
        short=history.short + 1 if run.ran < RESET_SECONDS else 0,
        unserved=0 if run.served else history.unserved + 1,
    )


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    step: Step
    delay: float
    """Seconds to wait before the restart (0 when there is none)."""
    looping: bool
    """The runs are a crash loop now (see :attr:`History.looping`)."""


def decide(history: History, last: Run, *, jitter: float) -> Verdict:
    """After ``last`` ended (``history`` includes it): start again, after how long, or end the sidecar.

    ``jitter`` is a number in [0, 1) (``random.random()``): the delay is scaled by ``0.5 + jitter / 2``.
    """
    if not history.served and (not last.killed or history.looping):
        return Verdict(Step.END, 0.0, history.looping)
    if history.short <= 1:
        return Verdict(Step.RESTART, 0.0, history.looping)
    base = min(MAX_DELAY, FIRST_DELAY * 2 ** min(history.short - 2, 32))
    return Verdict(Step.RESTART, base * (0.5 + min(max(jitter, 0.0), 1.0) / 2), history.looping)
