"""Which fault, when, for how long: a pure function of the seed and the run's length.

The same seed and minutes give the same schedule, printed with the report, so a run that found a broken
invariant can be run again. Faults that last (a full disk, the S3 server down or stopped) overlap the
point faults that fall inside them; process faults keep :data:`PROCESS_GAP` seconds apart so that each
restart is a restart and not a start that never finished. The faults that end the sidecar itself come only
before :func:`own_until`: one sidecar process lives through the rest, every other fault included, so that
its memory over the steady stretch (from :func:`steady_from`) says whether it leaks. In a run long enough to
judge that (a steady stretch of 20 minutes or more), the last such fault comes :data:`OWN_SETTLE` seconds
before the stretch, so the process judged has loaded its library and filled its caches when it begins.
"""

from __future__ import annotations

import dataclasses
import enum
import random


class Fault(enum.StrEnum):
    SERVER_KILL = "server_kill"
    """``kill -9`` of llama-server (the launcher's child), wherever it is (a save, a restore, a swap)."""
    SIDECAR_KILL = "sidecar_kill"
    """``kill -9`` of the sidecar, then a start again: its llama-server must not outlive it."""
    SIGTERM = "sigterm_restart"
    """SIGTERM of the sidecar (the whole product), then a start again."""
    DISK_FULL = "disk_full"
    """The store's disk filled to the last MiB, then the space given back."""
    S3_DOWN = "s3_down"
    """The shared store's S3 server stopped, then started again."""
    S3_SLOW = "s3_slow"
    """The S3 server frozen (SIGSTOP): every call hangs until SIGCONT."""
    CLIENT_LEAVES = "client_leaves"
    """A client closes its streamed request after the first bytes."""
    BURST = "burst"
    """New conversations, more than the slots, past the store's byte budget."""


PROCESS = frozenset({Fault.SERVER_KILL, Fault.SIDECAR_KILL, Fault.SIGTERM})
"""Faults that end a process the conversations are served by."""
OWN = frozenset({Fault.SIDECAR_KILL, Fault.SIGTERM})
"""Faults that end the sidecar itself: none in the steady stretch."""
LASTING = frozenset({Fault.DISK_FULL, Fault.S3_DOWN, Fault.S3_SLOW})
"""Faults with a duration: undone at its end."""

WEIGHTS: dict[Fault, float] = {
    Fault.SERVER_KILL: 5.0,
    Fault.SIDECAR_KILL: 1.5,
    Fault.SIGTERM: 1.0,
    Fault.DISK_FULL: 1.0,
    Fault.S3_DOWN: 1.0,
    Fault.S3_SLOW: 1.0,
    Fault.CLIENT_LEAVES: 2.0,
    Fault.BURST: 0.7,
}
MEAN_GAP = 9.0
"""Mean seconds between two faults (exponential gaps)."""
PROCESS_GAP = 12.0
"""Least seconds between two process faults."""
WARM_UP = 20.0
"""Seconds at the start without faults: the conversations' first turns."""
SETTLE = 15.0
"""Seconds at the end without new faults: every conversation gets a turn after the last one."""
LASTS = (4.0, 14.0)
"""Bounds of a lasting fault's duration, in seconds."""
STEADY_SHARE = 2 / 3
"""The last share of a run whose one sidecar process's RSS growth is judged: 40 of 60 minutes."""
OWN_SETTLE = 180.0
"""Seconds before the steady stretch without a fault that ends the sidecar, in a run long enough to judge its
RSS: a start loads the library and fills bounded caches, 102 to 147 MB in its first minute in a soak, then
147-149 MB for the next 13."""
JUDGED_STEADY = 1200.0
"""The least steady stretch, in seconds, over which the RSS growth is judged (shorter: caches filling)."""


def steady_from(seconds: float) -> float:
    """Seconds from the start of a run of ``seconds`` from which the one sidecar process's RSS is judged."""
    return seconds * (1.0 - STEADY_SHARE)


def own_until(seconds: float) -> float:
    """Seconds from the start of a run of ``seconds`` after which no fault ends the sidecar itself."""
    steady = steady_from(seconds)
    return steady - OWN_SETTLE if seconds - steady >= JUDGED_STEADY else steady


@dataclasses.dataclass(frozen=True, slots=True)
class Event:
    at: float
    """Seconds from the start of the run."""
    fault: Fault
    seconds: float = 0.0
    """How long it lasts (lasting faults); 0 for the others."""

    def describe(self) -> str:
        lasting = f" for {self.seconds:.1f} s" if self.seconds else ""
        return f"{self.at:7.1f} s  {self.fault.value}{lasting}"


def plan(seed: int, seconds: float) -> tuple[Event, ...]:
    """The faults of a run of ``seconds`` with ``seed``, in time order."""
    rng = random.Random(seed)
    kinds = list(WEIGHTS)
    weights = [WEIGHTS[kind] for kind in kinds]
    steady = [kind for kind in kinds if kind not in OWN]
    steady_weights = [WEIGHTS[kind] for kind in steady]
    steady_at = own_until(seconds)
    events: list[Event] = []
    busy_until = {kind: 0.0 for kind in LASTING}
    last_process = -PROCESS_GAP
    at = WARM_UP
    end = seconds - SETTLE
    while True:
        at += rng.expovariate(1.0 / MEAN_GAP)
        if at >= end:
            break
        fault = rng.choices(kinds, weights)[0]
        if fault in OWN and at >= steady_at:
            fault = rng.choices(steady, steady_weights)[0]
        if fault in PROCESS:
            if at - last_process < PROCESS_GAP:
                continue
            last_process = at
        lasts = 0.0
        if fault in LASTING:
            if at < busy_until[fault]:
                continue
            lasts = min(rng.uniform(*LASTS), end - at)
            busy_until[fault] = at + lasts
        events.append(Event(round(at, 2), fault, round(lasts, 2)))
    return tuple(events)


def counts(events: tuple[Event, ...]) -> dict[Fault, int]:
    """Faults by kind (every kind present, 0 if none)."""
    out = dict.fromkeys(Fault, 0)
    for event in events:
        out[event.fault] += 1
    return out
