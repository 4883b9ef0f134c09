"""What the library's placer asks of the rest of the sidecar: the engine, the tokenizer, the shared store."""

from __future__ import annotations

from typing import Any, Protocol

from sidecar.core import events
from sidecar.engine import listeners
from sidecar.restore import restorer
from sidecar.save import policy
from sidecar.shared import catalog, decide, records
from sidecar.snapshots import manifest


class Shared(Protocol):
    """The shared store as the request path needs it (``shared.service.SharedStore``)."""

    async def lookup(
        self, identity: events.Identity, chain: tuple[str, ...], *, max_tokens: int, owner: str
    ) -> catalog.Match | None: ...

    async def worth(self, match: catalog.Match, *, cached_tokens: int, prefill_rate: float) -> decide.Estimate: ...

    async def fetch(self, shared: records.SharedRecord, *, slot: int) -> manifest.Manifest | None: ...


class Slots(Protocol):
    """What the library asks of the engine that owns the slots (``slotservice.SlotService``); the engine decides."""

    def seen(self) -> tuple[events.Observation | None, events.Identity | None]:
        """The newest observation and identity of the server."""
        ...

    def unsaved(self, slot: int) -> bool:
        """Whether the slot holds content no snapshot holds."""
        ...

    def worth_saving(self, tokens: int) -> bool:
        """Whether a slot holding ``tokens`` is worth a snapshot (``--min-tokens``)."""
        ...

    async def fresh_slots(self) -> tuple[events.SlotView, ...]:
        """Every slot as the server shows it now; the engine's policy follows the read."""
        ...

    async def save(self, action: policy.Save) -> bool:
        """Save the slot if it is idle now; True if its content is in a snapshot."""
        ...

    def rebuild_ahead(self, record: manifest.Manifest) -> bool:
        """Begin rebuilding ``record`` while the slot it goes to is saved; False if not begun."""
        ...

    def rebuilt_ahead_done(self, record: manifest.Manifest) -> None:
        """The swap :meth:`rebuild_ahead` began for is over (restored or not)."""
        ...

    async def swap_in(
        self, slot: int, record: manifest.Manifest, *, counters: events.Counters | None, checked: bool = False
    ) -> restorer.RestoreRecord:
        """Restore ``record`` into the slot for a request (its own content saved first); ``checked``: committed
        just now, not hashed again."""
        ...

    async def erase(self, slot: int) -> bool:
        """Empty ``slot`` if it is idle (its content saved first by the caller); True if it is empty now."""
        ...

    def answered(self, slot: int, reused: int) -> None:
        """A routed request's own answer says the server reused ``reused`` prompt tokens in ``slot``."""

    def follow(self, listener: listeners.SlotListener) -> None:
        """Tell ``listener`` when the engine changes what the slots hold."""
        ...


class Tokenizer(Protocol):
    async def apply_template(self, body: dict[str, Any]) -> str: ...

    async def tokenize(self, text: str, *, owner: str) -> list[int]:
        """The ids of ``text``; what is remembered of ``owner``'s texts only may spare a round trip."""
        ...
