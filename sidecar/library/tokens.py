"""A prompt's token ids with as little of llama-server as exactness allows. I/O.

Invariants and trade-offs: docs/modules.md, `sidecar/library/tokens.py`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Protocol

from sidecar.core import events, metrics, outcomes
from sidecar.library import prefixes
from sidecar.snapshots import manifest

MARKERS = 256
"""Most piece texts remembered as special or not."""
_MARKER = re.compile(rb"<[^\s<>]{1,48}>")
"""What a template's special token looks like (``<start_of_turn>``, ``<|im_start|>``); the server confirms."""
_UNKNOWN = -2
"""Not yet shown special or not."""


class Server(Protocol):
    async def apply_template(self, body: dict[str, Any]) -> str: ...

    async def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        """The ids of ``text`` alone (``/tokenize`` without pieces: a smaller answer)."""
        ...

    async def pieces(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[tuple[int, bytes]]:
        """The ids of ``text`` and the bytes each stands for."""
        ...


def same_vocabulary(before: events.Identity | None, now: events.Identity | None) -> bool:
    """Whether ids learned from a server of identity ``before`` hold for one of identity ``now``: the same
    model file (by checksum, which holds the vocabulary) under the same build (which tokenizes). Pure."""
    return (
        before is not None
        and now is not None
        and before.weights is not None
        and before.weights == now.weights
        and before.build_info == now.build_info
    )


class Cached:
    def __init__(
        self,
        server: Server,
        *,
        stats: metrics.Metrics | None = None,
        max_ids: int = prefixes.MAX_IDS,
        vocabulary: Callable[[], events.Identity | None] | None = None,
    ) -> None:
        """``vocabulary``: the running server's identity as last read; without it a restart forgets every id."""
        self._server = server
        self._stats = stats
        self._vocabulary = vocabulary
        self._learned_under: events.Identity | None = None
        """The server's identity when what is remembered was learned (None: not read)."""
        self._recheck = vocabulary is not None
        """Compare the server's identity with :attr:`_learned_under` before the next text."""
        self._known = prefixes.Prefixes(max_ids)
        self._special: dict[bytes, int | None] = {}
        self.texts = 0
        """Texts tokenized (the bench and tests read these counts; never exported per text)."""
        self.text_bytes = 0
        """Bytes of those texts."""
        self.asked_bytes = 0
        """Bytes of prompt text sent to ``/tokenize`` for them."""
        self.answered = 0
        """Texts answered with no round trip."""
        self.refused = 0
        """Cuts the server's ids showed wrong (the text then asked whole)."""

    # ---- what the engine tells: listeners.SlotListener -----------------------------------

    def emptied(self) -> None:
        """The server lost its slots (a restart may bring another model): forget every id, unless the server's
        identity shows the same vocabulary before the next text."""
        if self._vocabulary is None:
            self._forget()
        self._recheck = True

    def rewound(self, slot: int, before: events.SlotContent, after: events.SlotContent) -> None:
        """Nothing to do: a slot's content says nothing of how the server tokenizes."""

    def _forget(self) -> None:
        self._known.clear()
        self._special.clear()

    def _settle(self) -> None:
        """Keep what is remembered only if the server tokenizes as when it was learned."""
        if self._vocabulary is None:
            return
        now = self._vocabulary()
        if not same_vocabulary(self._learned_under, now):
            self._forget()
        self._learned_under = now
        self._recheck = now is None  # unknown: look again at the next text

    def restored(self, slot: int, record: manifest.Manifest) -> None:
        """A restore changes no token ids."""

    def owner(self, slot: int) -> str | None:
        """The tokenizer knows no conversation's owner."""
        return None

    # ---- the placer's tokenizer -----------------------------------------------------------

    async def apply_template(self, body: dict[str, Any]) -> str:
        return await self._server.apply_template(body)

    async def tokenize(self, text: str, *, owner: str = "") -> list[int]:
        """The ids of ``text``, with what ``owner``'s requests taught (another owner's texts are not looked at)."""
        if self._recheck:
            self._settle()
        before = self.asked_bytes
        try:
            return await self._tokenize(text, owner)
        finally:
            self._count(len(text.encode()), self.asked_bytes - before)

    def _count(self, size: int, asked: int) -> None:
        self.texts += 1
        self.text_bytes += size
        if self._stats is not None:
            self._stats.library_prompt_bytes.labels(outcomes.PromptBytes.ASKED.value).inc(asked)
            self._stats.library_prompt_bytes.labels(outcomes.PromptBytes.REMEMBERED.value).inc(max(size - asked, 0))

    async def _tokenize(self, text: str, owner: str) -> list[int]:
        data = text.encode()
        hit = self._known.longest(data, owner)
        if hit is not None and hit.token == prefixes.WHOLE:
            self.answered += 1
            return hit.ids.tolist()
        if hit is not None:
            got = await self._server.pieces(data[hit.cut :].decode(), add_special=False)
            self.asked_bytes += len(data) - hit.cut
            if got and got[0][0] == hit.token:
                head = hit.ids.tolist()
                ids = head + [i for i, _ in got]
                await self._learn(data, hit.cut, ids, len(head), got, owner)
                return ids
            self.refused += 1  # the text there is no longer that special token for the server
        if self._no_cut(data):  # no cut to learn in it: the plain ids, as without the cache
            plain = await self._server.tokenize(text)
            self.asked_bytes += len(data)
            self._known.remember(data, len(data), plain, owner=owner)
            return plain
        got = await self._server.pieces(text, add_special=True)
        self.asked_bytes += len(data)
        ids = [i for i, _ in got]
        await self._learn(data, 0, ids, 0, got, owner)
        return ids

    async def _learn(
        self, data: bytes, cut: int, ids: list[int], start: int, got: list[tuple[int, bytes]], owner: str
    ) -> None:
        """Remember ``data`` whole, and its last special-token cut, when the pieces spell it from ``cut``."""
        sizes = [len(p) for _, p in got]
        if cut == 0 and got and b"".join(p for _, p in got[1:]) == data:
            sizes[0] = 0  # the BOS the server adds: no byte of the text
        elif b"".join(p for _, p in got) != data[cut:]:
            return  # the pieces do not spell the text: offsets unknown, ask whole each time
        self._known.remember(data, len(data), ids, owner=owner)
        shown = {p for _, p in got if _MARKER.fullmatch(p)}
        for found in _MARKER.finditer(data, cut):  # not one piece here: the server did not take it for a token
            if found.group() not in shown and found.group() not in self._special:
                self._note(found.group(), None)
        offset = len(data)
        for index in range(len(got) - 1, -1, -1):
            token, piece = got[index]
            offset -= sizes[index]
            if offset > cut and _MARKER.fullmatch(piece) and await self._is_special(piece, token):
                self._known.remember(data, offset, ids[: start + index], token=token, piece=piece, owner=owner)
                return

    def _no_cut(self, data: bytes) -> bool:
        """Whether every marker-looking text in ``data`` is known to be no special token: no cut to learn there."""
        return all(self._special.get(found.group(), _UNKNOWN) is None for found in _MARKER.finditer(data))

    def _note(self, piece: bytes, token: int | None) -> None:
        if len(self._special) >= MARKERS:
            self._special.clear()
        self._special[piece] = token

    async def _is_special(self, piece: bytes, token: int) -> bool:
        known = self._special.get(piece, _UNKNOWN)
        if known == _UNKNOWN:
            text = piece.decode()
            parsed = [i for i, _ in await self._server.pieces(text, add_special=False)]
            plain = [i for i, _ in await self._server.pieces(text, add_special=False, parse_special=False)]
            known = parsed[0] if len(parsed) == 1 and plain != parsed else None
            self._note(piece, known)
        return known == token
