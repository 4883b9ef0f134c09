"""The token ids of prompt texts already tokenized, by their leading bytes. Pure code.

A conversation's prompt text grows turn by turn: each turn's text starts
with the previous turn's up to the marker where the template opens the
reply. :class:`Prefixes` remembers, for a text the server tokenized, the ids
of its leading part up to a *cut* where tokenizing the two sides apart gives
the same ids as tokenizing the whole: the start of a special token (the
server splits special tokens out before it tokenizes the text between them,
so nothing on one side changes the ids of the other), or the text's end for
that very text. :meth:`Prefixes.longest` finds the longest remembered cut a
new text starts with, so only the rest needs the server.

Keys are BLAKE2b digests of the leading bytes; ids are kept packed (4 bytes
each) in a least-recently-used map bounded by a total count of ids. Nothing
here is logged or exported: neither text nor ids leave the process.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import hashlib
from collections.abc import Sequence

MAX_IDS = 4_000_000
"""Most token ids kept in all (16 MB packed)."""
_DIGEST = 16


@dataclasses.dataclass(frozen=True, slots=True)
class Hit:
    cut: int
    """How many leading bytes of the text the ids cover."""
    ids: array.array[int]


def _digest(data: bytes | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=_DIGEST).digest()


class Prefixes:
    def __init__(self, max_ids: int = MAX_IDS) -> None:
        self._max = max_ids
        self._held = 0
        self._entries: collections.OrderedDict[tuple[int, bytes, bool], array.array[int]] = collections.OrderedDict()
        self._lengths: collections.Counter[int] = collections.Counter()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def held_ids(self) -> int:
        return self._held

    def remember(self, data: bytes, cut: int, ids: Sequence[int], *, whole: bool = False) -> None:
        """The ids ``ids`` are those of ``data[:cut]`` tokenized apart from what follows.

        ``whole``: the ids of exactly ``data`` (``cut`` is its length), good
        for that text only, not for a longer one that starts with it.
        """
        if not 0 < cut <= len(data) or not ids or len(ids) > self._max or (whole and cut != len(data)):
            return
        key = (cut, _digest(memoryview(data)[:cut]), whole)
        old = self._entries.pop(key, None)
        if old is not None:
            self._held -= len(old)
            self._lengths[cut] -= 1
        packed = array.array("i", ids)
        self._entries[key] = packed
        self._held += len(packed)
        self._lengths[cut] += 1
        while self._held > self._max:
            (length, _, _), dropped = self._entries.popitem(last=False)
            self._held -= len(dropped)
            self._lengths[length] -= 1
            if not self._lengths[length]:
                del self._lengths[length]

    def longest(self, data: bytes) -> Hit | None:
        """The longest remembered cut that ``data`` starts with (or ``data`` whole), and its ids; None: none."""
        lengths = sorted(n for n in self._lengths if n <= len(data))
        if not lengths:
            return None
        view = memoryview(data)
        running = hashlib.blake2b(digest_size=_DIGEST)
        done = 0
        found: tuple[int, bytes, bool] | None = None
        for length in lengths:  # one pass over the bytes, a digest at each remembered length
            running.update(view[done:length])
            done = length
            digest = running.copy().digest()
            if (length, digest, False) in self._entries:
                found = (length, digest, False)
            if length == len(data) and (length, digest, True) in self._entries:
                found = (length, digest, True)
        if found is None:
            return None
        self._entries.move_to_end(found)
        return Hit(found[0], self._entries[found])
