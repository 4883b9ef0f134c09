"""Which models of a router-mode llama-server get an engine of their own. Pure code.

In router mode (``--models-dir`` / ``--models-preset``) one llama-server
lists several models and runs one child server per loaded model;
``GET /models`` says each model's state. The sidecar runs one engine per
listed model: the engine of an unloaded model sees its server as down, and
when the model is loaded again it sees a new, empty server and restores that
model's snapshots (the restart path). An engine stops when its model leaves
the list (removed from the models dir or preset). The list is the router's
configuration, so the number of engines (and of ``model`` label values) is
bounded by what the operator configured.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from sidecar.core import events


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    start: tuple[str, ...]
    """Models listed now that have no engine yet, in name order."""
    stop: tuple[str, ...]
    """Models with an engine that the router no longer lists, in name order."""
    left_out: tuple[str, ...] = ()
    """Listed models left without an engine because the limit is reached, in name order."""


def decide(listed: Mapping[str, events.ModelStatus], running: Iterable[str], *, limit: int) -> Plan:
    """Engines to start and stop so that each listed model has one, at most ``limit`` in all.

    Models whose server runs come first when ``limit`` cuts the list, then
    the others by name, so a cut never depends on the order of the reply.
    Engines already running are kept while their model is listed.
    """
    have = set(running)
    stop = sorted(have - set(listed))
    keep = have - set(stop)
    room = max(0, limit - len(keep))
    candidates = sorted((name for name in listed if name not in keep), key=lambda n: (not listed[n].running, n))
    return Plan(start=tuple(sorted(candidates[:room])), stop=tuple(stop), left_out=tuple(sorted(candidates[room:])))
