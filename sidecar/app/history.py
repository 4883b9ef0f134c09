"""A small in-memory ring of samples for the status page's charts. Pure code.

Every :data:`SAMPLE_SECONDS` the app records a :class:`Sample` of a few
cumulative numbers; the ring keeps :data:`CAPACITY` of them (six hours),
nothing is written to disk and a restart of the sidecar starts it empty
(Prometheus is the long-term record). :func:`series` turns the samples
into per-interval figures: restores in each interval, the share of prompt
tokens llama-server served from its KV cache in each interval, and the
prefill seconds saved so far.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools

SAMPLE_SECONDS = 60.0
"""Seconds between two samples."""
CAPACITY = 360
"""Samples kept: six hours at one a minute."""


@dataclasses.dataclass(frozen=True, slots=True)
class Sample:
    at: float
    """Unix time of the sample."""
    restores: float
    """``llama_sidecar_restores_total{result="ok"}`` summed over slots (restore rounds and swaps)."""
    saved_seconds: float
    """``llama_sidecar_prefill_saved_seconds_total`` summed."""
    prompt_tokens: float | None
    """llama-server's ``llamacpp:prompt_tokens_total`` (None when its /metrics is not read)."""
    cached_tokens: float | None
    """llama-server's ``llamacpp:prompt_tokens_cached_total``."""


@dataclasses.dataclass(frozen=True, slots=True)
class Point:
    at: float
    value: float | None
    """None where the interval has no figure (no prompt tokens at all, counters unread)."""


class History:
    def __init__(self, capacity: int = CAPACITY) -> None:
        self._ring: collections.deque[Sample] = collections.deque(maxlen=capacity)

    def add(self, sample: Sample) -> None:
        self._ring.append(sample)

    def samples(self) -> tuple[Sample, ...]:
        return tuple(self._ring)


def _growth(before: float, after: float) -> float:
    """A counter's growth between two readings; a counter that went back was reset (a restart): it grew by its value."""
    return after - before if after >= before else after


def restores(samples: tuple[Sample, ...]) -> list[Point]:
    """Restores (rounds and swaps) that ended ok in each interval, at the interval's end."""
    return [Point(b.at, _growth(a.restores, b.restores)) for a, b in itertools.pairwise(samples)]


def hit_rate(samples: tuple[Sample, ...]) -> list[Point]:
    """Share (0-1) of the interval's prompt tokens the server took from its KV cache instead of prefilling."""
    points: list[Point] = []
    for a, b in itertools.pairwise(samples):
        if a.prompt_tokens is None or a.cached_tokens is None or b.prompt_tokens is None or b.cached_tokens is None:
            points.append(Point(b.at, None))
            continue
        cached = _growth(a.cached_tokens, b.cached_tokens)
        total = cached + _growth(a.prompt_tokens, b.prompt_tokens)
        points.append(Point(b.at, cached / total if total > 0 else None))
    return points


def saved(samples: tuple[Sample, ...]) -> list[Point]:
    """Prefill seconds saved since the sidecar started, at each sample."""
    return [Point(s.at, s.saved_seconds) for s in samples]
