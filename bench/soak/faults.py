"""Each fault of the schedule, done and undone on the running product; what it saw, counted.

A process fault records the sidecar's own outage (from the fault to ``/readyz`` 200 again) so that the
errors of the requests it held are told apart from errors no fault explains. A ``kill -9`` of the sidecar
checks that its llama-server ends with it (no orphan); a SIGTERM checks the exit status and that no
llama-server is left.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import math
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path

from bench.beds import s3bed, wait
from bench.soak import invariants, product, schedule

ORPHAN_WAIT = 10.0
"""Seconds a killed sidecar's llama-server has to end by itself."""
FILL_LEFT = 1 << 20
"""Bytes left free on the store's disk while it is full."""
FILL_TRIES = 3
"""Fills of the store's disk tried, each after measuring its free space again, before it counts as full for a
moment only."""


@dataclasses.dataclass(slots=True)
class Lasting:
    """A fault done: from ``at`` until ``until`` (+inf while a lasting fault is on; ``at`` for a point fault)."""

    fault: schedule.Fault
    at: float
    until: float


@dataclasses.dataclass(slots=True)
class Seen:
    """What the faults did and saw: the invariants' windows, the sidecar's outages, and the counters."""

    windows: list[Lasting] = dataclasses.field(default_factory=list)
    outages: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    down_since: float | None = None
    """When the sidecar went down by a fault, while it is not back."""
    done: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    skipped: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    orphans: int = 0
    sigterm_status: list[int] = dataclasses.field(default_factory=list)
    sigterm_seconds: list[float] = dataclasses.field(default_factory=list)
    back_seconds: list[float] = dataclasses.field(default_factory=list)
    """Seconds from each sidecar fault to ``/readyz`` 200 again."""
    notes: list[str] = dataclasses.field(default_factory=list)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def windows_now(self) -> list[invariants.Window]:
        with self.lock:
            return [invariants.Window(w.fault, w.at, w.until) for w in self.windows]


class Faults:
    def __init__(
        self,
        *,
        rig: product.Product,
        s3: s3bed.S3Server,
        disk: Path,
        clock: Callable[[], float],
        say: Callable[[str], None],
        leave: Callable[[], str | None],
        burst: Callable[[], int],
    ) -> None:
        """``disk``: the mount of the store's disk; ``leave``: a client leaves mid-stream (what happened, or None:
        no client to do it); ``burst``: new conversations start (how many)."""
        self.rig, self.s3, self.disk, self.clock, self.say = rig, s3, disk, clock, say
        self._leave, self._burst = leave, burst
        self.seen = Seen()
        self._filler = disk / "soak-filler"
        self._restarting: threading.Thread | None = None
        """The sidecar's start after a process fault: waited for in the background, so the schedule goes on."""

    def restarting(self) -> bool:
        return self._restarting is not None and self._restarting.is_alive()

    def settle(self, timeout: float = 300.0) -> None:
        """Wait for a start in progress to finish."""
        if self._restarting is not None:
            self._restarting.join(timeout)

    def begin(self, event: schedule.Event) -> None:
        at = self.clock()
        window = Lasting(event.fault, at, math.inf if event.fault in schedule.LASTING else at)
        with self.seen.lock:
            self.seen.windows.append(window)  # before it is done: a turn that sees it knows of it
        try:
            did = self._do(event.fault)
        except Exception as exc:  # a fault the soak could not do is said and counted, never the end of the run
            self.seen.notes.append(f"{at:.1f} s {event.fault.value} could not be done: {exc.__class__.__name__}: {exc}")
            did = ""
        if not did:
            with self.seen.lock:
                self.seen.windows.remove(window)
            self.seen.skipped[event.fault.value] += 1
            return
        if event.fault is schedule.Fault.DISK_FULL and not self._filler.exists():
            with self.seen.lock:
                window.until = self.clock()  # full for a moment only: its window is not the scheduled length
        self.seen.done[event.fault.value] += 1
        self.say(f"{at:7.1f} s  {event.fault.value}: {did}")

    def end(self, event: schedule.Event) -> None:
        """Undo a lasting fault."""
        with self.seen.lock:
            open_ = [w for w in self.seen.windows if w.fault is event.fault and w.until == math.inf]
        if not open_:
            return
        try:
            self._undo(event.fault)
        except Exception as exc:  # said and counted; the run's clean-up undoes what is left
            self.seen.notes.append(f"{self.clock():.1f} s {event.fault.value} could not be undone: {exc}")
        with self.seen.lock:
            open_[-1].until = self.clock()
        self.say(f"{self.clock():7.1f} s  {event.fault.value} undone")

    def _undo(self, fault: schedule.Fault) -> None:
        if fault is schedule.Fault.DISK_FULL:
            with contextlib.suppress(FileNotFoundError):
                self._filler.unlink()
        elif fault is schedule.Fault.S3_DOWN:
            self.s3.start()
        elif fault is schedule.Fault.S3_SLOW and self.s3.proc is not None:
            os.killpg(self.s3.proc.pid, signal.SIGCONT)

    def undo_all(self) -> None:
        """Undo every lasting fault still on (the run is ending)."""
        for fault in schedule.LASTING:
            self.end(schedule.Event(0.0, fault))

    def _do(self, fault: schedule.Fault) -> str:
        """Do ``fault``; what happened, in words ("" when it could not be done now)."""
        match fault:
            case schedule.Fault.SERVER_KILL:
                pid = self.rig.child_pid()
                if pid is None:
                    return ""
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                return f"llama-server {pid} killed"
            case schedule.Fault.SIDECAR_KILL:
                return "" if self.restarting() else self._sidecar_kill()
            case schedule.Fault.SIGTERM:
                return "" if self.restarting() else self._sigterm()
            case schedule.Fault.DISK_FULL:
                return self._fill()
            case schedule.Fault.S3_DOWN:
                self.s3.stop()
                return "S3 server stopped"
            case schedule.Fault.S3_SLOW:
                if self.s3.proc is None or self.s3.proc.poll() is not None:
                    return ""
                os.killpg(self.s3.proc.pid, signal.SIGSTOP)
                return "S3 server frozen"
            case schedule.Fault.CLIENT_LEAVES:
                return self._leave() or ""
            case schedule.Fault.BURST:
                return f"{self._burst()} new conversations"

    def _fill(self) -> str:
        """Fill the store's disk but :data:`FILL_LEFT`, measured again when a fill races the product's writes.

        A fill that runs out of space was full for a moment all the same (the product's writes then may fail),
        so it stays a fault, its window ending as it was done; it used to be dropped as not done, and what it
        did went unexplained."""
        for _ in range(FILL_TRIES):
            free = product_free(self.disk)
            if free <= FILL_LEFT:
                return ""
            try:
                with self._filler.open("wb") as out:
                    os.posix_fallocate(out.fileno(), 0, free - FILL_LEFT)
            except OSError as exc:
                self._filler.unlink(missing_ok=True)
                if exc.errno != errno.ENOSPC:
                    raise
                continue
            return f"store disk filled ({(free - FILL_LEFT) >> 20} MiB)"
        return f"store disk full for a moment ({FILL_TRIES} fills raced the product's writes and ran out of space)"

    def outages_now(self, now: float) -> list[tuple[float, float]]:
        """The sidecar's outages so far, one still running included (until ``now``)."""
        with self.seen.lock:
            running = [] if self.seen.down_since is None else [(self.seen.down_since, now)]
            return [*self.seen.outages, *running]

    def _sidecar_kill(self) -> str:
        at = self.clock()
        self.seen.down_since = at
        child = self.rig.child_pid()
        self.rig.kill9()
        gone = child is None or _ends(child, ORPHAN_WAIT)
        if not gone and child is not None:
            self.seen.orphans += 1
            self.seen.notes.append(f"llama-server {child} outlived its sidecar's kill -9 by {ORPHAN_WAIT:g} s")
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        self._restart(at)
        return f"sidecar killed (its llama-server {child} {'ended with it' if gone else 'ORPHANED'}), starting again"

    def _sigterm(self) -> str:
        at = self.clock()
        self.seen.down_since = at
        code, took = self.rig.sigterm()
        self.seen.sigterm_status.append(code)
        self.seen.sigterm_seconds.append(took)
        left = product.servers_of(self.rig.slot_dir)
        if left:
            self.seen.orphans += len(left)
            self.seen.notes.append(f"llama-server {left} left running after the sidecar's SIGTERM")
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self._restart(at)
        return f"SIGTERM: exit status {code} after {took:.1f} s, starting again"

    def _restart(self, at: float) -> None:
        self.rig.start()
        self._restarting = threading.Thread(target=self._back, args=(at,), name="sidecar-start", daemon=True)
        self._restarting.start()

    def _back(self, at: float) -> None:
        try:
            self.rig.wait_ready()
        except AssertionError as exc:
            self.seen.notes.append(f"the sidecar did not get ready after its start at {at:.1f} s: {exc}")
        back = self.clock()
        self.say(f"{back:7.1f} s  the sidecar is ready again, {back - at:.1f} s after its fault")
        self.seen.back_seconds.append(back - at)
        with self.seen.lock:
            self.seen.outages.append((at, back))
            self.seen.down_since = None


def _ends(pid: int, timeout: float) -> bool:
    try:
        wait.wait_until(lambda: not product.alive(pid), timeout=timeout, what=f"pid {pid} to end", every=0.05)
    except AssertionError:
        return False
    return True


def product_free(path: Path) -> int:
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize
