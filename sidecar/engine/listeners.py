"""Who is told when the engine changes what the slots hold (the library's placer and tokenizer)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from sidecar.core import apikeys, events
from sidecar.snapshots import manifest


class SlotListener(Protocol):
    """Told what the slots hold when the engine changes it (the library's routing listens)."""

    def emptied(self) -> None:
        """The server lost every slot's KV (a restart or a wake-up)."""

    def restored(self, slot: int, record: manifest.Manifest) -> None:
        """The restore round put ``record`` into ``slot``."""

    def rewound(self, slot: int, before: events.SlotContent, after: events.SlotContent) -> None:
        """A save brought ``slot`` back to its prompt's boundary: its content went from ``before`` to ``after`` by
        the sidecar's own request on it (``save.rewind``), not by another client's turn."""

    def owner(self, slot: int) -> str | None:
        """Whose conversation ``slot`` holds (``apikeys.owner_of``), recorded in its next snapshot; None: unknown."""


class Listeners:
    """Every :class:`SlotListener` of one engine, told in the order they came."""

    def __init__(self, listeners: Iterable[SlotListener] = ()) -> None:
        self._listeners = list(listeners)

    def follow(self, listener: SlotListener) -> None:
        """Tell ``listener`` too, from now on: for one that asks the engine itself (the placer), so exists only
        after it."""
        self._listeners.append(listener)

    def emptied(self) -> None:
        for listener in self._listeners:
            listener.emptied()

    def restored(self, slot: int, record: manifest.Manifest) -> None:
        for listener in self._listeners:
            listener.restored(slot, record)

    def rewound(self, slot: int, before: events.SlotContent, after: events.SlotContent) -> None:
        for listener in self._listeners:
            listener.rewound(slot, before, after)

    def owner(self, slot: int) -> str:
        """Whose conversation ``slot`` holds, as the listeners know it; ``apikeys.NOBODY`` if none knows."""
        return next(
            (o for o in (listener.owner(slot) for listener in self._listeners) if o is not None), apikeys.NOBODY
        )
