"""The seams of the proxy's request path: the library that places a completion (:class:`Pinner`), what one
placement gives back (:class:`Placement`), and router mode's door per model (:data:`Admit`).

Invariants and trade-offs: docs/modules.md, `sidecar/proxy/relay.py`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Protocol

from sidecar.core import outcomes
from sidecar.proxy import answer, bodies, tickets

Admit = Callable[[outcomes.Route, bytes], Awaitable[bodies.Refusal | None]]
"""Router mode: waits until a request may be forwarded (its model loaded and restored); or the answer instead."""


class Placement(Protocol):
    """A completion placed by the library: the body to forward, and what its answer came to."""

    @property
    def body(self) -> bytes:
        """The body to forward (pinned with ``id_slot`` where the route takes it, or as it came)."""

    @property
    def header(self) -> str:
        """The value of ``sending.PREFIX_HEADER`` for the client; "" for none."""

    @property
    def counted(self) -> bool:
        """Whether :meth:`answered` needs the answer's reuse figure (``Ended.cached``); else it is not read."""

    @property
    def later(self) -> bool:
        """Not placed: a request let through before the restore round ended waits for the whole round."""

    def answered(self, ended: answer.Ended) -> None:
        """llama-server's answer was relayed (to its end, or cut): count it from its own figures."""


class Pinner(Protocol):
    """Places a completion before it is forwarded (the library pins it to the slot that holds its KV)."""

    def pin(
        self, raw_path: str, body: bytes, *, owner: str, ticket: tickets.Ticket
    ) -> contextlib.AbstractAsyncContextManager[Placement]:
        """The placement, valid until the request ends; never raises for a bad request.

        ``owner``: whose conversation it is (``apikeys.NOBODY`` without API keys): only that owner's KV serves it.
        ``ticket``: the request's admission, let through by the gate (``Ticket.within``: the slots restored so far
        by the restore round that let it through early); the pinner reserves the slot it pins it to there.
        """

    async def prepare(self, raw_path: str, body: bytes, *, owner: str) -> str | None:
        """What needs no slot (the token ids), done while the request waits for a restore round; never raises.

        Returns the snapshot file whose restore the request waits for (None: the whole round).
        """
