"""Whether fetching a snapshot from the shared store beats computing its tokens again. Pure code.

A download saves the prefill of the tokens it holds and costs the transfer
(bytes over the measured bandwidth), a fixed overhead per fetch (requests,
the checksum, the commit, the restore call) and nothing else. It is worth
it only when that is clearly less than the prefill it replaces.

Bandwidth is measured from this node's own transfers (:class:`Rate`, an
exponentially weighted mean); until one has happened a conservative
default stands in. The prefill rate is the caller's: llama-server's
``llamacpp:prompt_tokens_seconds`` or its timings.
"""

from __future__ import annotations

import dataclasses
import enum

DEFAULT_BANDWIDTH = 25e6
"""Bytes per second assumed before any transfer was measured (a modest network link)."""
FETCH_OVERHEAD = 0.25
"""Seconds a fetch costs besides the transfer: round trips, checksum, commit, restore."""
MARGIN = 0.8
"""A fetch must take less than this share of the prefill it saves."""


class Verdict(enum.StrEnum):
    FETCH = "fetch"
    PREFILL = "prefill"


@dataclasses.dataclass(frozen=True, slots=True)
class Estimate:
    verdict: Verdict
    fetch_seconds: float
    prefill_seconds: float


def fetch_or_prefill(
    *, size: int, saved_tokens: int, bandwidth: float, prefill_rate: float, overhead: float = FETCH_OVERHEAD
) -> Estimate:
    """Compare fetching ``size`` bytes at ``bandwidth`` B/s with prefilling ``saved_tokens`` at ``prefill_rate`` t/s."""
    fetch = overhead + size / max(bandwidth, 1.0)
    prefill = saved_tokens / max(prefill_rate, 1e-9)
    verdict = Verdict.FETCH if saved_tokens > 0 and fetch < MARGIN * prefill else Verdict.PREFILL
    return Estimate(verdict, fetch, prefill)


@dataclasses.dataclass(slots=True)
class Rate:
    """Bytes per second of recent transfers, weighted towards the newest."""

    weight: float = 0.3
    value: float | None = None

    def add(self, size: int, seconds: float) -> None:
        if size <= 0 or seconds <= 0:
            return
        sample = size / seconds
        self.value = sample if self.value is None else self.weight * sample + (1 - self.weight) * self.value

    def current(self) -> float:
        return DEFAULT_BANDWIDTH if self.value is None else self.value
