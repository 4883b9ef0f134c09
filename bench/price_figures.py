"""The proxy's price as figures: each the median of pairs, a turn straight to llama-server and the same turn through
the proxy, sent one right after the other (see :func:`_paired`); the records :mod:`bench.price` judges.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from bench import proxy as proxy_mod
from bench import rig

DIRECT, PROXY = proxy_mod.DIRECT, proxy_mod.PROXY
SAME_WORK_TOKENS = 16
"""Prompt tokens the server may process more for the proxied turn than for the direct one and still count as the
same work (see :func:`_swapped`)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Api:
    name: str
    turn_ms: dict[str, list[float]]
    """Non-streamed warm turns, to the answer's end, per way."""
    first_ms: dict[str, list[float]]
    """Streamed warm turns, to the first byte of the answer's body, per way."""
    cpu_us: float
    """The sidecar's CPU time per proxied turn, its idle polling subtracted (µs)."""
    outside_ms: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    """``first_ms`` less llama-server's own compute for the turn (its prompt and generation seconds)."""
    compute_ms: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    """llama-server's own compute for each non-streamed turn of ``turn_ms`` (its prompt and generation seconds)."""
    turn_tokens: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    """Prompt tokens llama-server processed (not reused) for each turn of ``turn_ms``."""
    first_tokens: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    """Prompt tokens llama-server processed (not reused) for each streamed turn of ``first_ms``."""

    def ratio(self, part: slice = slice(None)) -> float:
        """Through the proxy over direct, per turn, as measured (see :func:`_paired`)."""
        return _paired(self.turn_ms, part, _ratio)

    def added(self, part: slice = slice(None)) -> float:
        """Through the proxy minus direct, per streamed turn, as measured (ms; see :func:`_paired`)."""
        return _paired(self.first_ms, part, _difference)

    def turn_ratio(self, part: slice = slice(None)) -> float:
        """:meth:`ratio` with each proxied turn of the same work given the direct turn's compute (the goal's figure).

        See :func:`_swapped`; as measured for a ``results.json`` from before the server's compute was read.
        """
        if not self.compute_ms:
            return self.ratio(part)
        swapped = _swapped(self.turn_ms, self.compute_ms, self.turn_tokens)
        return _paired({DIRECT: self.turn_ms[DIRECT], PROXY: swapped}, part, _ratio)

    def first_added(self, part: slice = slice(None)) -> float:
        """:meth:`added` with each proxied turn of the same work given the direct turn's compute (ms; the goal's)."""
        if not self.first_tokens:
            return self.added(part)
        compute = {
            way: [f - o for f, o in zip(self.first_ms[way], self.outside_ms[way], strict=True)]
            for way in (DIRECT, PROXY)
        }
        swapped = _swapped(self.first_ms, compute, self.first_tokens)
        return _paired({DIRECT: self.first_ms[DIRECT], PROXY: swapped}, part, _difference)

    def different_work(self) -> int:
        """Pairs, of both kinds, where the server processed more for the proxied turn (counted as measured)."""
        return sum(_more_work(tokens) for tokens in (self.turn_tokens, self.first_tokens) if tokens)

    def outside(self, part: slice = slice(None)) -> float:
        """:meth:`added` with llama-server's own compute for each turn taken out, both ways (ms; NaN if not read).

        The compute of one streamed turn varies by tens of milliseconds on a
        loaded 2-core machine, the same way both ways, and buries a few
        milliseconds of the proxy's; what is left is the rest of the turn's
        path (HTTP, template, tokenizing, the slot cache, the proxy). A
        diagnostic, not the goal: it leaves out whatever the proxy would make
        the server's compute cost (its CPU beside the server's threads).
        """
        return _paired(self.outside_ms, part, _difference) if self.outside_ms else float("nan")


def _paired(ms: dict[str, list[float]], part: slice, of: Callable[[float, float], float]) -> float:
    """``of(direct, proxy)`` for each turn in ``part`` (the two ways' same turn, sent one right after the
    other), its median over the turns where each way went first, and the mean of those two.

    Paired, not two medians taken apart: the server's own time drifts over a run (the machine, the
    growing prompts) by more than the proxy adds. And per order: the way sent second waits for the
    server's work after the first (with the RAM prompt cache on, its task first copies the slot the
    other just changed: about 17 ms on these histories), so the pairs of each order sit about that far
    on either side of the proxy's own price, and one median over both orders lands anywhere between
    the two; the order changes every pair, so each half holds one order.
    """
    by_order: tuple[list[float], list[float]] = ([], [])
    for i in range(len(ms[DIRECT]))[part]:
        by_order[i % 2].append(of(ms[DIRECT][i], ms[PROXY][i]))
    medians = [rig.median(values) for values in by_order if values]
    return sum(medians) / len(medians)


def _swapped(ms: dict[str, list[float]], compute: dict[str, list[float]], tokens: dict[str, list[int]]) -> list[float]:
    """The proxied turns' times, each with the direct turn's server compute in place of its own where the server
    did the same work for both (it processed at most :data:`SAME_WORK_TOKENS` more prompt tokens for the proxy's).

    llama-server's compute for one turn swings by tens of milliseconds on a loaded 2-core machine, each turn
    on its own, and buries the few milliseconds the proxy adds; given the same work, that swing is the
    server's, not the proxy's. What is left to compare is the rest of the turn's path: HTTP, the library's
    template, tokens and slot, the relay. A proxied turn that made the server process more (a missed route,
    a slot it had to fill) keeps its own compute: that cost is the proxy's. Not taken out: anything the
    proxy's CPU costs the server's threads while they compute (the proxy's CPU per request is beside it).
    """
    out = []
    for i, proxied in enumerate(ms[PROXY]):
        same = tokens[PROXY][i] - tokens[DIRECT][i] <= SAME_WORK_TOKENS
        out.append(proxied - compute[PROXY][i] + compute[DIRECT][i] if same else proxied)
    return out


def _more_work(tokens: dict[str, list[int]]) -> int:
    return sum(p - d > SAME_WORK_TOKENS for d, p in zip(tokens[DIRECT], tokens[PROXY], strict=True))


def _ratio(direct: float, proxy: float) -> float:
    return proxy / direct


def _difference(direct: float, proxy: float) -> float:
    return proxy - direct


@dataclasses.dataclass(frozen=True, slots=True)
class Crash:
    tokens: int
    crashed_ms: list[float]
    """The turn sent the moment the restarted server answered /health, to its answer's end."""
    calm_ms: list[float]
    """The same turn with no crash before it."""
    cache_n: list[int]
    """Prompt tokens each crashed turn reused (the server's ``timings.cache_n``)."""
    calm_cache_n: list[int]

    @property
    def ratios(self) -> list[float]:
        return [c / k for c, k in zip(self.crashed_ms, self.calm_ms, strict=True)]

    @property
    def ratio(self) -> float:
        """The median of the crashes' ratios (each crash against the calm turn right before it)."""
        return rig.median(self.ratios)


@dataclasses.dataclass(frozen=True, slots=True)
class Result:
    tokens: int
    apis: list[Api]
    non_routed: list[proxy_mod.Latency]
    crash: Crash
    quick: bool


def non_routed_added(lat: proxy_mod.Latency, part: slice = slice(None)) -> float:
    """What the proxy added to a non-routed request, per pair (ms; see :func:`_paired`)."""
    return _paired({DIRECT: lat.direct_ms, PROXY: lat.proxy_ms}, part, _difference)
