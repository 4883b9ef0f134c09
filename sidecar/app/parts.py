"""What the wiring of one mode hands to the lifecycle (``app.run``): the shared wiring of plain and router mode.

Plain mode (:mod:`sidecar.app.plain`) and router mode (:mod:`sidecar.app.routermode`) each make a
:class:`Parts`; ``app.run`` serves it, runs its tasks and closes it, whatever the mode.

Invariants and trade-offs: docs/modules.md, `sidecar/app/run.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from sidecar.core import config
from sidecar.engine import gate, report
from sidecar.library import reads
from sidecar.proxy import placing
from sidecar.shared import service


@dataclasses.dataclass(frozen=True, slots=True)
class Parts:
    """What the wiring made for one mode: a plain llama-server, or a router's models."""

    engines: report.Engines
    """The engine, or the fleet's engines in router mode: what the HTTP layer reads and what takes the final
    snapshots."""
    loops: dict[str, Coroutine[Any, Any, None]]
    """The tasks that watch the server(s), by name."""
    restore_gate: gate.Gate
    """Where the proxy holds completion requests."""
    admit: placing.Admit | None = None
    """Router mode: which model's gate a request waits at."""
    shared: service.SharedStore | None = None
    library: placing.Pinner | None = None
    slots_reader: reads.SlotsReader | None = None
    """The library's read of /slots on a routed request's path (closed after the proxy)."""
    quiet: Callable[[float], None] | None = None
    """Hold the poller's reads for a while (a client left a request llama-server runs); None in router mode."""

    def close_unstarted(self) -> None:
        """Close the watch loops that never ran (a start-up failure): no "coroutine was never awaited" at exit."""
        for loop_ in self.loops.values():
            loop_.close()


def cache_dir(settings: config.Settings) -> Path:
    """Where the model files' checksums are remembered: the slot dir, or the state dir when the slot dir is the
    RAM staging dir removed at exit (the next start would hash the model again)."""
    state = settings.launch.state_dir
    return state if settings.snapshots.staging == "ram" and state is not None else settings.snapshots.slot_dir
