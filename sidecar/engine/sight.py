"""What the engine has seen of the llama-server it watches, shared by its parts.

The engine is split by job (:mod:`.consumer`, :mod:`.runner`, :mod:`.saves`,
:mod:`.slotservice`, :mod:`.statusview`); each reads the server through one
:class:`Sight`: the newest observation handled, the server's identity, and
what is known of the server process (:class:`process.ServerProcess`, renewed
only by the consumer when the server loses its slots).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import structlog

from sidecar.core import events
from sidecar.engine import probe, process

log = structlog.get_logger("sidecar.engine")


@dataclasses.dataclass(slots=True)
class Sight:
    slot_dir: Path
    """Where the server writes its slot files (logged with the link's proof)."""
    latest: events.Observation | None = None
    """The newest observation handled; None before the first."""
    identity: events.Identity | None = None
    """The newest identity the server gave (its /props); None before the first."""
    server: process.ServerProcess = dataclasses.field(default_factory=process.ServerProcess)
    """What the engine knows of the server process it watches now (renewed in ``Consumer._slots_emptied``)."""
    slot_count: int = 0

    def ready(self, obs: events.Observation) -> bool:
        """Whether slot actions may be sent: up, slots and identity read, awake (an action would wake it)."""
        return (
            obs.health is events.Health.OK and obs.slots is not None and self.identity is not None and not obs.sleeping
        )

    def set_link(self, link: probe.Link) -> None:
        if link == self.server.link:
            return
        self.server.link = link
        if link.ok:
            log.info("slot_dir_linked", slot_dir=str(self.slot_dir))
        elif link.ok is False:
            log.error("slot_dir_not_linked", problem=link.problem)
