"""Whether fetching a snapshot from the shared store beats computing its tokens again. Pure code.

Invariants and trade-offs: docs/modules.md, `sidecar/shared/decide.py`.
"""

from __future__ import annotations

import dataclasses
import enum

from sidecar.restore import savings

DEFAULT_BANDWIDTH = 25e6
"""Bytes per second assumed before any transfer was measured (a modest network link)."""
FETCH_OVERHEAD = 0.25
"""Seconds a fetch costs besides the transfer: round trips, checksum, commit, restore."""
DEFAULT_PREFILL_RATE = 5000.0
"""Prompt tokens per second assumed when no rate was ever measured on this model (fast: favours prefill)."""
MIN_MEASURED_TOKENS = savings.MIN_MEASURED_TOKENS
"""Prefilled tokens below which the server's own rate is too noisy to use."""
MARGIN = 0.8
"""A fetch must take less than this share of the prefill it saves."""


class RateSource(enum.StrEnum):
    """Where the prefill rate of a fetch-or-prefill decision came from."""

    SERVER = "server"
    """This llama-server's own, over its lifetime."""
    SNAPSHOT = "snapshot"
    """The rate the snapshot's manifest records: the node that made it, on the same model."""
    KEPT = "kept"
    """The newest rate this node recorded in its own snapshots (it outlives a restart)."""
    DEFAULT = "default"


class Verdict(enum.StrEnum):
    FETCH = "fetch"
    PREFILL = "prefill"


@dataclasses.dataclass(frozen=True, slots=True)
class Estimate:
    verdict: Verdict
    fetch_seconds: float
    prefill_seconds: float
    bytes: int = 0
    """Bytes the fetch would download."""


def fetch_or_prefill(
    *, size: int, saved_tokens: int, bandwidth: float, prefill_rate: float, overhead: float = FETCH_OVERHEAD
) -> Estimate:
    """Compare fetching ``size`` bytes at ``bandwidth`` B/s with prefilling ``saved_tokens`` at ``prefill_rate`` t/s."""
    fetch = overhead + size / max(bandwidth, 1.0)
    prefill = saved_tokens / max(prefill_rate, 1e-9)
    verdict = Verdict.FETCH if saved_tokens > 0 and fetch < MARGIN * prefill else Verdict.PREFILL
    return Estimate(verdict, fetch, prefill, size)


def prefill_rate(*, prompt_tokens: float, prompt_seconds: float) -> float:
    """Tokens per second the server prefilled over its lifetime; the default until it prefilled enough."""
    if prompt_tokens < MIN_MEASURED_TOKENS or prompt_seconds <= 0:
        return DEFAULT_PREFILL_RATE
    return prompt_tokens / prompt_seconds


def pick_prefill_rate(*, server: float | None, snapshot: float | None, kept: float | None) -> tuple[float, RateSource]:
    """The first measured rate of: this server's own, the snapshot's recorded one, this node's kept one."""
    for rate, source in ((server, RateSource.SERVER), (snapshot, RateSource.SNAPSHOT), (kept, RateSource.KEPT)):
        if rate is not None and rate > 0:
            return rate, source
    return DEFAULT_PREFILL_RATE, RateSource.DEFAULT


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
