"""What every part of one engine shares, given once: the :class:`Wiring`, and the :class:`Part` that holds it.

The engine (:mod:`.engine`) makes one :class:`Wiring` and gives it to each
of its parts at construction; a part keeps the shared collaborators under
the same attribute names as every other part, so code moves between them
as it stands.
"""

from __future__ import annotations

import dataclasses

from sidecar.core import metrics, protocols
from sidecar.engine import gate, listeners, sight
from sidecar.restore import restorer
from sidecar.save import policy
from sidecar.slots import actions
from sidecar.snapshots import store


@dataclasses.dataclass(frozen=True, slots=True)
class Wiring:
    client: protocols.Upstream
    slot_actions: actions.SlotActions
    """The one road to the server's slot actions, with the lock that keeps them one at a time."""
    snapshots: store.SnapshotStore
    stats: metrics.Metrics
    clock: protocols.Clock
    decider: policy.Policy
    """The pure policy: when a slot is due for a save, what it holds as saved."""
    seen: sight.Sight
    told: listeners.Listeners
    restore_gate: gate.Gate
    """Closed while the server is down or loading and while a restore round is owed or running."""
    restoring: restorer.Restorer


class Part:
    """One of the engine's parts: the collaborators they all share, from one :class:`Wiring`."""

    def __init__(self, wiring: Wiring) -> None:
        self._client = wiring.client
        self._actions = wiring.slot_actions
        self._snapshots = wiring.snapshots
        self._stats = wiring.stats
        self._clock = wiring.clock
        self._policy = wiring.decider
        self._sight = wiring.seen
        self._listeners = wiring.told
        self._gate = wiring.restore_gate
        self._restorer = wiring.restoring
