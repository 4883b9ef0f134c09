"""What llama-server's own RAM prompt cache holds, as far as the sidecar can tell. Pure code.

Invariants and trade-offs: docs/modules.md, `sidecar/library/ramtier.py`.
"""

from __future__ import annotations

import collections
import dataclasses
import enum

from sidecar.library import turns
from sidecar.snapshots import slotfile


class State(enum.StrEnum):
    TRYING = "trying"
    """Not shown yet: conversations go to RAM only with their content saved first."""
    CONFIRMED = "confirmed"
    """An answer reused what the model held: a conversation may leave its slot for RAM unsaved (see the placer)."""
    OFF = "off"
    """An answer showed the model wrong (or ``--server-cache-ram-bytes 0``): the library swaps from disk."""


@dataclasses.dataclass(frozen=True, slots=True)
class Held:
    owner: str
    chain: tuple[str, ...]
    bytes: int
    turn: turns.Key | None = None
    """The key of the request the slot ran last before it left, if the slot held what that request left: a
    request that continues it is this conversation coming back (placed with no round trip to tokenize)."""


_Text = bytes
"""A text prompt's bytes (``RamTier.bytes`` is a figure of the tier's)."""


class RamTier:
    def __init__(self, capacity: int) -> None:
        """``capacity``: the server's ``--cache-ram`` in bytes (0: it has none, the tier is off)."""
        self.capacity = capacity
        self.state = State.TRYING if capacity > 0 else State.OFF
        self._held: collections.OrderedDict[tuple[str, tuple[str, ...]], Held] = collections.OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._held)

    @property
    def bytes(self) -> int:
        return self._bytes

    def left(self, owner: str, chain: tuple[str, ...], size: int, turn: turns.Key | None = None) -> None:
        """A conversation of ``chain`` (``size`` bytes of KV) left its slot for a task of another: the server
        copied it into RAM. A copy it holds of a prefix of it is replaced; one it holds of a longer one stays.
        ``turn``: the key of the request the slot ran last (:attr:`Held.turn`)."""
        if self.state is State.OFF or not chain or size <= 0 or size > self.capacity:
            return
        for key, held in list(self._held.items()):
            if held.owner != owner:
                continue
            shared = slotfile.shared_blocks(chain, held.chain)
            if shared == len(chain):
                return  # the server keeps the longer one it has, and copies nothing
            if shared == len(held.chain):
                self._drop(key)
        self._held[(owner, chain)] = Held(owner, chain, size, turn)
        self._bytes += size
        while self._bytes > self.capacity:
            self._drop(next(iter(self._held)))

    def best(self, owner: str, request: tuple[str, ...]) -> tuple[Held | None, int]:
        """The held conversation of ``owner``'s sharing the most leading blocks with ``request``, and how many."""
        if self.state is State.OFF:
            return None, 0
        found: Held | None = None
        blocks = 0
        for held in self._held.values():
            if held.owner != owner:
                continue
            shared = slotfile.shared_blocks(request, held.chain)
            if shared > blocks:
                found, blocks = held, shared
        return found, blocks

    def continued(self, owner: str, turn: turns.Key, text: _Text = b"") -> Held | None:
        """The held conversation of ``owner``'s that a request of key ``turn`` (text prompt ``text``) continues,
        the longest such: its prompt starts with all that conversation's last request held."""
        if self.state is State.OFF:
            return None
        found: Held | None = None
        for held in self._held.values():
            if held.owner != owner or held.turn is None or not held.turn.continued_by(turn, text):
                continue
            if found is None or found.turn is None or held.turn.length > found.turn.length:
                found = held
        return found

    def loaded(self, held: Held) -> None:
        """The server took ``held`` out of RAM into a slot."""
        self._drop((held.owner, held.chain))

    def served(self) -> None:
        """An answer reused what the model said RAM held."""
        if self.state is State.TRYING:
            self.state = State.CONFIRMED

    def missed(self) -> None:
        """An answer showed RAM did not hold what the model said: off until the server restarts."""
        self.state = State.OFF
        self.clear()

    def clear(self) -> None:
        """The server lost its RAM (a restart)."""
        self._held.clear()
        self._bytes = 0

    def restarted(self) -> None:
        """A new server process: nothing in RAM, and its cache to be shown again."""
        self.clear()
        self.state = State.TRYING if self.capacity > 0 else State.OFF

    def _drop(self, key: tuple[str, tuple[str, ...]]) -> None:
        held = self._held.pop(key, None)
        if held is not None:
            self._bytes -= held.bytes
