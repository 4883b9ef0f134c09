"""What the placer knows of each slot beyond ``/slots``, and whether a snapshot is an exact prefix. Pure code."""

from __future__ import annotations

import asyncio
import dataclasses

from sidecar.library import turns
from sidecar.snapshots import manifest, slotfile


@dataclasses.dataclass(slots=True)
class SlotState:
    """What the sidecar knows of one slot beyond /slots."""

    chain: tuple[str, ...] = ()
    """Hash chain of the prompt routed there last, or of the snapshot restored into it."""
    used: float = 0.0
    """Monotonic time a routed request last ended or was pinned there (the requests pinned there now are the
    placer's live tickets that reserve the slot: ``proxy.tickets``)."""
    ended: float = 0.0
    """Unix time a routed request last ended there (its content changed then)."""
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    """Held while the slot is being saved and swapped."""
    seen: tuple[int, int] | None = None
    """The slot's (task, tokens) at the last fresh read before a placement; None: not known."""
    routed_since: bool = False
    """A routed request ended there since ``seen`` was read (it explains a change of content)."""
    restored: manifest.Index | None = None
    """The snapshot a restore or a swap put there, while the slot holds only that: on a model that
    cannot cut a state back the server has no checkpoints of it, so it serves only an exact prefix."""
    turn: turns.Key | None = None
    """The key of the request routed there last, while the slot holds what that request left (its prompt's
    tokens are then the slot's first ones): a request that continues it goes there with no round trip."""
    owner: str | None = None
    """Whose conversation ``chain`` is (``apikeys.owner_of``; ``apikeys.NOBODY`` without API keys); None: unknown.
    Only a request of the same owner is routed to what the slot holds."""
    leaving: tuple[tuple[str, ...], str | None] | None = None
    """While a swap saves what the slot held before another conversation is restored there: that content's
    chain and owner (``chain`` already names the one swapped in). A request of it waits for the save."""

    def holds(self, chain: tuple[str, ...], turn: turns.Key | None = None, owner: str | None = None) -> None:
        """The slot holds ``chain`` of ``owner`` now (and, with ``turn``, the prompt of the request of that key)."""
        self.chain, self.turn, self.owner = chain, turn, owner

    def continues(self, turn: turns.Key, text: bytes, owner: str) -> bool:
        """Whether a request of ``owner`` whose key is ``turn`` (and text prompt ``text``) continues the
        conversation this slot ran last."""
        return self.turn is not None and self.owner == owner and self.turn.continued_by(turn, text)

    def same_conversation(self, turn: turns.Key, text: bytes, owner: str) -> bool:
        """Whether such a request is the conversation this slot ran last, continued or with a late message
        edited (:meth:`turns.Key.same_conversation`): what it cuts off of the slot is not kept for later."""
        return self.turn is not None and self.owner == owner and self.turn.same_conversation(turn, text)

    def rewound(self, before: tuple[int, int], after: tuple[int, int]) -> None:
        """The engine's rewind before a save changed the slot from ``before`` to ``after``: as last seen, it still
        holds the prefix routed there (cut back to that prompt's boundary). A read of it before the save commits
        would otherwise take the change for another client's turn and forget the prefix: a request of that
        conversation routed then went to an older snapshot of it, and lost its newest turn."""
        if self.seen == before:
            self.seen = after

    def holds_for(self, owner: str) -> tuple[str, ...]:
        """What the slot holds as a request of ``owner`` may use it: nothing of another owner's."""
        return self.chain if self.owner == owner else ()

    def leaving_for(self, owner: str) -> tuple[str, ...]:
        """What a swap is saving of the slot as it leaves, as a request of ``owner`` may use it."""
        if self.leaving is None or self.leaving[1] != owner:
            return ()
        return self.leaving[0]


def exact_prefix(index: manifest.Index | None, packed: bytes) -> bool:
    """Whether every token of the snapshot ``index`` describes is a prefix of the request's ids ``packed``.

    Strictly shorter: the server needs at least one token of the request to process.
    """
    if index is None or index.whole is None:
        return False
    size = index.tokens * 4
    return 0 < size < len(packed) and slotfile.whole_hash(packed[:size]) == index.whole
