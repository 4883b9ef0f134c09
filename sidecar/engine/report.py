"""What the sidecar knows right now, as one frozen value, and the seam the HTTP layer reads it through.

The engine builds a :class:`Status` on demand from its own state; the HTTP
layer depends on the small :class:`Engines` protocol only (the status, and
the two admin actions), never on the engine's attributes.

:class:`Liveness` is the pure rule behind ``/healthz``: the poll loop is
alive while the engine keeps finishing polls. Every call the loop makes to
llama-server has a timeout, so a loop that has finished no poll for longer
than those timeouts allow (a poll's calls, a few intervals, and the slot
actions running) is stuck: on a hung disk, a lock never released, a bug.
Only a restart of the sidecar clears that, which is what a liveness probe
does. A llama-server that hangs does not stop the loop: its calls time out
and the loop goes on, so the sidecar stays live (and not ready).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

from sidecar.core import config, events
from sidecar.restore import restorer, savings
from sidecar.save import records

CHECK_GRACE = 5.0
"""Seconds past its deadline a snapshot file's check may run before the sidecar counts as stuck."""
STALL_POLLS = 5
"""Poll intervals the loop may miss before it counts as stuck."""
CALLS_PER_POLL = 8
"""Most calls one poll makes, each bounded by the request timeout: /health, /props, /v1/models,
/metrics and /slots, then /props, /v1/models and /metrics again after a restart."""


@dataclasses.dataclass(frozen=True, slots=True)
class Status:
    server_url: str
    observation: events.Observation | None
    """The newest poll handed to the engine; None before the first."""
    identity: events.Identity | None
    """The server's identity as last read from /props."""
    link_ok: bool | None
    """Whether the server is known to write into the slot dir (None: not yet known)."""
    link_problem: str
    last_snapshot: records.SaveRecord | None
    last_restore: tuple[restorer.RestoreRecord, ...]
    progress_at: float
    """Monotonic time, in seconds, when the engine last finished handling a poll (its start before the first)."""
    acting: bool
    """A slot action (a save, a restore round, the slot-dir probe) is running."""
    restore_gate: str = ""
    """Why the restore gate is closed (server down or loading, restore round owed or running); "" when open."""
    saved: savings.Totals = dataclasses.field(default_factory=savings.Totals)
    """Prefill seconds the sidecar's restores and swaps saved, as estimated so far."""
    recent: tuple[restorer.Done, ...] = ()
    """The newest restores and swaps that put tokens back, with their verdicts, oldest first."""
    slot_since: tuple[tuple[int, float], ...] = ()
    """(slot, Unix time its content last changed as the sidecar saw it)."""
    check: restorer.Check | None = None
    """The snapshot file being checked (hashed) now, and by when its check must end; None between checks."""
    low_disk: bool = False
    """The newest save was skipped: the slot dir is below ``--min-free-bytes`` (until a save finds room)."""
    models: tuple[tuple[str, Status], ...] = ()
    """Router mode: each watched model's own status (its engine's), by model name; empty otherwise."""


@dataclasses.dataclass(frozen=True, slots=True)
class SaveReply:
    """Outcome of an admin's save of one slot."""

    ok: bool
    record: records.SaveRecord | None


class Engines(Protocol):
    """The seam to a node's engines: one ``engine.Engine`` beside a plain llama-server, the ``fleet.Fleet`` of one
    engine per model in router mode. The HTTP layer reads the status and asks the admin's actions through it;
    the wiring takes the final snapshots."""

    def status(self) -> Status: ...

    async def save_now(self, slot: int) -> SaveReply | None:
        """Save ``slot`` now; None when the newest poll shows no such slot holding tokens."""
        ...

    async def restore_now(self) -> Sequence[restorer.RestoreRecord]:
        """A restore round into the slots that are empty now."""
        ...

    async def final_snapshots(self) -> None:
        """Save every changed, idle slot once more before the process exits."""
        ...


@dataclasses.dataclass(frozen=True, slots=True)
class Liveness:
    """How long the poll loop may go without finishing a poll before it counts as stuck."""

    poll_seconds: float
    """Longest a poll may take, every call timing out, plus :data:`STALL_POLLS` intervals."""
    action_seconds: float
    """Longest one slot action may take: its call's timeout, plus a /slots read before a restore."""

    @classmethod
    def of(cls, settings: config.Settings) -> Liveness:
        upstream, poll = settings.upstream, settings.poll
        return cls(
            poll_seconds=STALL_POLLS * max(poll.interval, poll.down_interval)
            + CALLS_PER_POLL * upstream.request_timeout,
            action_seconds=upstream.action_timeout + upstream.request_timeout,
        )

    def bound(self, status: Status) -> float:
        """Seconds allowed without an observation; a restore round may act on every slot in turn."""
        if not status.acting:
            return self.poll_seconds
        slots = len(status.observation.slots or ()) if status.observation is not None else 0
        return self.poll_seconds + self.action_seconds * max(1, slots)

    def stall(self, status: Status, now: float) -> str | None:
        """Why the loop counts as stuck at monotonic time ``now``, or None while it makes progress.

        While a snapshot file is being checked, its own deadline decides (a hash gives up at it,
        so a check past it is blocked in the kernel: a hung disk or mount).
        """
        if status.check is not None:
            late = now - status.check.deadline
            if late <= CHECK_GRACE:
                return None
            return (
                f"the check of snapshot {status.check.file} has run {late:.0f} s past its deadline: a read of the "
                "slot dir is blocked (a hung disk or network mount); restart the sidecar, and check that filesystem"
            )
        quiet = now - status.progress_at
        bound = self.bound(status)
        if quiet <= bound:
            return None
        during = ", a slot action included" if status.acting else ""
        return (
            f"the poll loop has finished no poll of llama-server for {quiet:.0f} s, more than the {bound:.0f} s "
            f"its timeouts allow{during}: it is stuck; restart the sidecar, and check the slot dir's "
            "filesystem if this repeats"
        )
