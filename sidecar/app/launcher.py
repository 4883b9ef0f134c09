"""Launcher mode's wiring (``run ... -- llama-server ARGS``): the supervisor of llama-server and its task.

The supervisor starts llama-server, restarts it when it ends and stops it after the final snapshots
(:mod:`sidecar.launch.supervisor`); a second signal kills it at once (:mod:`sidecar.app.signals`).

Invariants and trade-offs: docs/modules.md, `sidecar/app/run.py`.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any

import structlog

from sidecar.core import metrics
from sidecar.engine import gate
from sidecar.launch import argv, supervisor

log = structlog.get_logger("sidecar.app")


def supervise(launch: argv.Launch | None, stats: metrics.Metrics) -> supervisor.Supervisor | None:
    """The supervisor of the llama-server command (launcher mode); None beside a server run elsewhere."""
    if launch is None:
        return None
    launcher = supervisor.Supervisor(launch, stats=stats)
    if launch.listen is not None:
        log.info(
            "proxy_takes_server_address",
            taken=list(launch.taken),
            hosts=list(launch.listen[0]),
            port=launch.listen[1],
            server=launch.url,
            effect="clients reach llama-server at the address its command gave it, through the proxy; "
            "llama-server itself listens on a private loopback port",
            hint="--no-proxy keeps llama-server on its own address (no restore gate, no library); "
            "--proxy-listen puts the proxy elsewhere",
        )
    return launcher


def tasks(launcher: supervisor.Supervisor | None, restore_gate: gate.Gate) -> dict[str, Coroutine[Any, Any, None]]:
    """The ``launcher`` task, which a crash of llama-server tells the gate of; none beside a server run elsewhere."""
    if launcher is None:
        return {}
    return {"launcher": launcher.run(restore_gate.suspect, lambda: restore_gate.openings)}
