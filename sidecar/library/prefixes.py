"""The token ids of prompt texts already tokenized, by their leading bytes. Pure code.

Invariants and trade-offs: docs/modules.md, `sidecar/library/prefixes.py`.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

MAX_IDS = 4_000_000
"""Most token ids kept in all (16 MB packed)."""
_DIGEST = 16
WHOLE = -1
"""The ``token`` of a text remembered whole: no special token follows, good for that text only."""


@dataclasses.dataclass(frozen=True, slots=True)
class Hit:
    cut: int
    """How many leading bytes of the text the ids cover."""
    ids: array.array[int]
    token: int = WHOLE
    """The special token that starts at ``cut`` (its id), or ``WHOLE`` for a text known whole."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Entry:
    ids: array.array[int]
    token: int
    piece: bytes


def _hasher(owner: str) -> Any:
    """The digest of one owner's texts (``apikeys.owner_of``, 16 bytes in hex, as BLAKE2b's salt): a text one
    owner's requests taught is found for that owner only, so no timing of ``/tokenize`` tells another of it."""
    return hashlib.blake2b(digest_size=_DIGEST, salt=bytes.fromhex(owner) if owner else b"")


def _digest(data: bytes | memoryview, owner: str) -> bytes:
    hasher = _hasher(owner)
    hasher.update(data)
    digest: bytes = hasher.digest()
    return digest


class Prefixes:
    def __init__(self, max_ids: int = MAX_IDS) -> None:
        self._max = max_ids
        self._held = 0
        self._entries: collections.OrderedDict[tuple[int, bytes, bool], _Entry] = collections.OrderedDict()
        self._lengths: collections.Counter[int] = collections.Counter()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def held_ids(self) -> int:
        return self._held

    def clear(self) -> None:
        self._entries.clear()
        self._lengths.clear()
        self._held = 0

    def remember(
        self, data: bytes, cut: int, ids: Sequence[int], *, token: int = WHOLE, piece: bytes = b"", owner: str = ""
    ) -> None:
        """The ids ``ids`` are those of ``data[:cut]`` tokenized apart from what follows, for ``owner``.

        ``token`` and ``piece``: the special token that follows the cut in
        ``data`` (its id and bytes); the cut serves only a text that goes on
        with it. Without them (``WHOLE``): the ids of exactly ``data``
        (``cut`` is its length), good for that text only.
        """
        whole = token == WHOLE
        if not 0 < cut <= len(data) or not ids or len(ids) > self._max:
            return
        if (whole and cut != len(data)) or (not whole and data[cut : cut + len(piece)] != piece):
            return
        key = (cut, _digest(memoryview(data)[:cut], owner), whole)
        old = self._entries.pop(key, None)
        if old is not None:
            self._held -= len(old.ids)
            self._lengths[cut] -= 1
        entry = _Entry(array.array("i", ids), token, piece)
        self._entries[key] = entry
        self._held += len(entry.ids)
        self._lengths[cut] += 1
        while self._held > self._max:
            (length, _, _), dropped = self._entries.popitem(last=False)
            self._held -= len(dropped.ids)
            self._lengths[length] -= 1
            if not self._lengths[length]:
                del self._lengths[length]

    def longest(self, data: bytes, owner: str = "") -> Hit | None:
        """The longest cut remembered for ``owner`` that ``data`` starts with and goes on from as remembered (or
        ``data`` whole)."""
        lengths = sorted(n for n in self._lengths if n <= len(data))
        if not lengths:
            return None
        view = memoryview(data)
        running = _hasher(owner)
        done = 0
        found: tuple[int, bytes, bool] | None = None
        for length in lengths:  # one pass over the bytes, a digest at each remembered length
            running.update(view[done:length])
            done = length
            digest = running.copy().digest()
            cut = self._entries.get((length, digest, False))
            if cut is not None and view[length : length + len(cut.piece)] == cut.piece:
                found = (length, digest, False)
            if length == len(data) and (length, digest, True) in self._entries:
                found = (length, digest, True)
        if found is None:
            return None
        self._entries.move_to_end(found)
        entry = self._entries[found]
        return Hit(found[0], entry.ids, entry.token)
