"""What the engine knows of the llama-server process it watches now, in one object renewed in one place.

kopf keeps what it knows of one resource in a ``ResourceMemory``; the engine
keeps what it knows of the server process it watches now in a
:class:`ServerProcess` (not "memory": that word is the model's memory kind,
``events.Memory``, read from the GGUF header): whether the snapshot files were
checked while the server was down, whether the server is known to write into
the slot dir, which process this is. When the server loses its slots (a new
process, or a wake-up from sleep), the engine replaces it with
:meth:`ServerProcess.renewed`; nothing else resets it. Where the server is in
its life (down, loading, a restore round owed or running, serving, suspected)
is not kept here but in its gate's :class:`sidecar.engine.lifecycle.Life`.
"""

from __future__ import annotations

import dataclasses

from sidecar.engine import probe


@dataclasses.dataclass(slots=True)
class ServerProcess:
    epoch: int = 0
    """Server processes seen before this one (restarts and wake-ups): a save's outcome counts only in its own."""
    prechecked: bool = False
    """The files the restore round will need were checked since the server last went down."""
    link: probe.Link = probe.UNKNOWN
    """Whether this server process is known to write into our slot dir."""
    healthy_at: float | None = None
    """When a poll first saw this process healthy: where the restart-to-restore latency starts."""
    adopted: bool = False
    """The slots whose content matches their newest snapshot were taken as saved (once, at start-up)."""

    def renewed(self, *, at: float, new_process: bool) -> ServerProcess:
        """What is known of a server that just lost its slots at ``at``.

        ``new_process``: a restart (the new process may have another --slot-save-path, so the
        link is unknown again); a wake-up keeps it.
        """
        return dataclasses.replace(
            self,
            epoch=self.epoch + 1,
            link=probe.UNKNOWN if new_process else self.link,
            healthy_at=at,
        )
