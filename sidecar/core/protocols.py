"""The seams between the sidecar's logic and the world: the server it watches, and time.

:class:`Upstream` is what the poller, engine, snapshotter, restorer and
slot-dir probe need from llama-server; ``upstream.LlamaClient`` implements
it over HTTP, and the unit tests implement it in memory. :class:`Clock` is
the one source of time: ``monotonic`` for every duration and deadline,
``wall`` for timestamps shown to people and written to manifests. Every
component that needs time takes one (``clock=``, :class:`SystemClock` by
default), the store and the restore gate included. The one exception: how
long a call of the sidecar's own took, observed in a duration histogram or
logged as ``seconds=``, is timed with ``time.perf_counter``, so that a test's
hand-moved clock never makes a measured figure.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Protocol

from sidecar.core import events


@dataclasses.dataclass(frozen=True, slots=True)
class ActionResult:
    """Reply of a slot save or restore."""

    slot: int
    filename: str
    tokens: int
    """``n_saved`` or ``n_restored``."""
    bytes: int
    """``n_written`` or ``n_read``."""
    server_ms: float
    """``timings.save_ms`` or ``timings.restore_ms``."""


class Upstream(Protocol):
    """llama-server as the sidecar uses it; every failure is an ``errors.UpstreamError``."""

    @property
    def url(self) -> str: ...

    async def health(self) -> tuple[events.Health, str]:
        """The server's state, and what went wrong when it is not OK (never raises)."""
        ...

    async def slots(self) -> tuple[events.SlotView, ...]: ...

    async def props(self) -> tuple[events.Identity, bool]:
        """The identity without the model's size and parameter count, and whether the server sleeps."""
        ...

    async def model_meta(self) -> tuple[int | None, int | None]:
        """(size in bytes, parameter count) of the loaded model, each None if unknown (never raises)."""
        ...

    async def adapters(self) -> tuple[events.Adapter, ...] | None:
        """The LoRA adapters loaded (``GET /lora-adapters``); None if the server does not say."""
        ...

    async def counters(self) -> events.Counters: ...

    async def save(self, slot: int, filename: str) -> ActionResult: ...

    async def erase(self, slot: int) -> int:
        """Empty ``slot``; returns the tokens it held."""
        ...

    async def restore(self, slot: int, filename: str) -> ActionResult: ...


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never steps: for durations, deadlines and ``Observation.at``."""
        ...

    def wall(self) -> float:
        """Unix time: for timestamps people read (``/status``, retention by age)."""
        ...


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()
