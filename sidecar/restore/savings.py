"""Prefill seconds the sidecar saved: the tokens the server reused after a restore or a swap,
priced at the server's own measured prefill rate. Pure code.

Only an effective restore or swap counts, for the tokens the server then reused; the rate is
llama-server's own prefill tokens over prefill seconds, kept across its restarts. An estimate, on
the small side.

Invariants and trade-offs: docs/modules.md, `sidecar/restore/savings.py`.
"""

from __future__ import annotations

import dataclasses

from sidecar.core import events, outcomes

MIN_MEASURED_TOKENS = 512
"""Prefilled tokens below which a server process's own rate is too noisy to use."""


@dataclasses.dataclass(frozen=True, slots=True)
class Totals:
    """What :class:`Savings` has counted so far, for /status and the page."""

    seconds: float = 0.0
    """Prefill seconds saved, all causes."""
    tokens: int = 0
    """Reused tokens priced so far."""
    by: tuple[tuple[str, float], ...] = ()
    """Seconds saved per :class:`outcomes.SavedBy` word."""
    rate: float | None = None
    """Prompt tokens per second the server prefilled, as last measured; None before the first."""
    unpriced_tokens: int = 0
    """Reused tokens waiting for the first measured rate."""


@dataclasses.dataclass(frozen=True, slots=True)
class Priced:
    """Reused tokens just priced: what to add to the counters."""

    by: outcomes.SavedBy
    tokens: int
    seconds: float


def measured_rate(counters: events.Counters) -> float | None:
    """The server's prefill rate over its lifetime in tokens per second; None until it prefilled enough."""
    if counters.prompt_tokens < MIN_MEASURED_TOKENS or counters.prompt_seconds <= 0:
        return None
    return counters.prompt_tokens / counters.prompt_seconds


def saved_tokens(*, restored: int, reused: float) -> int:
    """Tokens a restore of ``restored`` tokens spared the server when its next task reused ``reused``."""
    return max(0, min(restored, int(reused)))


class Savings:
    """The running estimate; :meth:`observe` and :meth:`reused` return what to count."""

    def __init__(self) -> None:
        self._rates: dict[str, float] = {}
        """The last trusted rate per model path."""
        self._model = ""
        self._waiting: dict[outcomes.SavedBy, int] = {}
        self._seconds: dict[outcomes.SavedBy, float] = dict.fromkeys(outcomes.SavedBy, 0.0)
        self._tokens = 0

    @property
    def rate(self) -> float | None:
        return self._rates.get(self._model)

    def observe(self, counters: events.Counters | None, identity: events.Identity | None) -> list[Priced]:
        """Take the rate of fresh counters; price the tokens that waited for one."""
        if identity is not None:
            self._model = identity.model_path
        if counters is not None and (rate := measured_rate(counters)) is not None:
            self._rates[self._model] = rate
        if self.rate is None or not self._waiting:
            return []
        waiting, self._waiting = self._waiting, {}
        return [self._price(by, tokens) for by, tokens in waiting.items()]

    def reused(self, by: outcomes.SavedBy, tokens: int) -> Priced | None:
        """``tokens`` reused thanks to ``by``: priced now, or None while no rate is known (kept until one is)."""
        if tokens <= 0:
            return None
        if self.rate is None:
            self._waiting[by] = self._waiting.get(by, 0) + tokens
            return None
        return self._price(by, tokens)

    def _price(self, by: outcomes.SavedBy, tokens: int) -> Priced:
        rate = self.rate
        assert rate is not None
        seconds = tokens / rate
        self._seconds[by] += seconds
        self._tokens += tokens
        return Priced(by, tokens, seconds)

    def totals(self) -> Totals:
        return Totals(
            seconds=sum(self._seconds.values()),
            tokens=self._tokens,
            by=tuple((by.value, s) for by, s in self._seconds.items()),
            rate=self.rate,
            unpriced_tokens=sum(self._waiting.values()),
        )


def merge(parts: list[Totals]) -> Totals:
    """The totals of several engines (router mode: one per model); no single rate stands for them."""
    by: dict[str, float] = {}
    for part in parts:
        for word, seconds in part.by:
            by[word] = by.get(word, 0.0) + seconds
    return Totals(
        seconds=sum(p.seconds for p in parts),
        tokens=sum(p.tokens for p in parts),
        by=tuple(by.items()),
        rate=parts[0].rate if len(parts) == 1 else None,
        unpriced_tokens=sum(p.unpriced_tokens for p in parts),
    )
