"""llama-server's two rate gauges as its other readers would see them, whatever the sidecar reads (pure).

Every read of llama-server's ``/metrics`` ends the window its rate gauges
(``llamacpp:prompt_tokens_seconds``, ``llamacpp:predicted_tokens_seconds``) average over: they are
the decode steps of the work finished since the previous read, over its time (``server-context.cpp``
resets the buckets on every scrape). The sidecar reads ``/metrics`` every poll, so a Prometheus
scraping llama-server would see the rate of the last second or nothing (0.0).

The ledger undoes that for every read that goes through the proxy. Each read's window has the same
time as the growth of the matching counter (``prompt_seconds_total``, ``tokens_predicted_seconds_total``:
both are fed the same microseconds as the bucket), so ``steps = rate * seconds`` recovers the window's
steps. The ledger adds up the windows of every read since the last scrape that went through the
proxy, and that scrape is answered with the sum of steps over the sum of seconds: the value
llama-server would have printed had nobody else read it in between (to the printed counters' six
significant digits). A new process (its ``Process-Start-Time-Unix`` changed, or counters went back)
starts the sums afresh.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

GAUGES = {
    "llamacpp:prompt_tokens_seconds": "llamacpp:prompt_seconds_total",
    "llamacpp:predicted_tokens_seconds": "llamacpp:tokens_predicted_seconds_total",
}
"""Each rate gauge, and the counter of the seconds its window is made of."""
_LINE = re.compile(rb"^(llamacpp:(?:prompt|predicted)_tokens_seconds) (\S+)$", re.MULTILINE)


@dataclasses.dataclass(slots=True)
class _Sums:
    steps: float = 0.0
    seconds: float = 0.0

    def rate(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else 0.0


class Ledger:
    """The windows of llama-server's rate gauges read by anyone since the last read through the proxy."""

    def __init__(self) -> None:
        self._start: str | None = None
        self._totals: dict[str, float] | None = None
        self._sums = {gauge: _Sums() for gauge in GAUGES}

    def read(self, start: str | None, values: Mapping[str, float]) -> None:
        """A read of ``/metrics`` (its ``Process-Start-Time-Unix`` header and values): its window is noted."""
        if not all(name in values for pair in GAUGES.items() for name in pair):
            return  # not a llama-server /metrics this ledger knows: nothing to note
        totals = {seconds: values[seconds] for seconds in GAUGES.values()}
        before = self._totals
        if start != self._start or before is None:
            # A new process (or the first read): its buckets were last reset when it started.
            self._start, before = start, dict.fromkeys(totals, 0.0)
            self._sums = {gauge: _Sums() for gauge in GAUGES}
        elif any(totals[name] < before[name] for name in totals):
            return  # an older read answered late: its window is inside the one already noted
        for gauge, seconds_total in GAUGES.items():
            seconds = totals[seconds_total] - before[seconds_total]
            self._sums[gauge].steps += values[gauge] * seconds
            self._sums[gauge].seconds += seconds
        self._totals = totals

    def scrape(self, start: str | None, values: Mapping[str, float]) -> dict[str, float]:
        """A read for a client: its window noted, and each gauge's value since the last such read (sums reset)."""
        self.read(start, values)
        found = {gauge: sums.rate() for gauge, sums in self._sums.items()}
        self._sums = {gauge: _Sums() for gauge in GAUGES}
        return found


def values_of(text: bytes) -> dict[str, float]:
    """The plain ``name value`` samples of a Prometheus text answer (llama-server's has no labels)."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(b"#"):
            continue
        name, _, value = line.partition(b" ")
        try:
            found[name.decode("ascii")] = float(value)
        except (UnicodeDecodeError, ValueError):
            continue
    return found


def rewrite(text: bytes, rates: Mapping[str, float]) -> bytes:
    """``text`` with each rate gauge's sample line set to ``rates``' value, printed as llama-server prints (``%g``)."""

    def one(match: re.Match[bytes]) -> bytes:
        name = match.group(1).decode("ascii")
        if name not in rates:
            return match.group(0)
        return match.group(1) + b" " + f"{rates[name]:g}".encode("ascii")

    return _LINE.sub(one, text)


def for_client(ledger: Ledger, start: str | None, text: bytes) -> bytes:
    """llama-server's ``/metrics`` answer ``text`` as it would have been had only the proxy's clients read it."""
    return rewrite(text, ledger.scrape(start, values_of(text)))
