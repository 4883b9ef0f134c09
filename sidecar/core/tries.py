"""Failed admin-token tries per client address: a few free, then a lockout that doubles, capped. Pure.

A wrong token from an address counts against it; past :attr:`Tries.free`
failures the address must wait before its next try, 1 s after the first
failure past them, doubling with each further one up to :attr:`Tries.cap`.
While it waits, every request of it that needs the token is refused unread
(429), the right token included, so guessing runs at most one try per
``cap`` seconds per address. The right token clears the address.

Memory is bounded: at most :attr:`Tries.addresses` addresses are kept (the
one that failed longest ago is forgotten first), and an address that has
not failed for :attr:`Tries.forget` seconds starts afresh. An attacker with
more addresses than that can get an address forgotten early, no faster than
it can try from fresh addresses anyway.
"""

from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass(slots=True)
class _Record:
    failures: int
    last: float
    """Monotonic time of the last failure."""
    until: float
    """Monotonic time before which the address is refused unread."""


class Tries:
    def __init__(
        self,
        *,
        free: int = 5,
        first: float = 1.0,
        cap: float = 60.0,
        addresses: int = 4096,
        forget: float = 3600.0,
    ) -> None:
        self.free = free
        """Failures an address may make before it has to wait."""
        self.first = first
        """Seconds of the first wait, doubled by each further failure."""
        self.cap = cap
        """Longest wait, in seconds."""
        self.addresses = addresses
        """Addresses kept at most."""
        self.forget = forget
        """Seconds after its last failure when an address starts afresh."""
        self._records: collections.OrderedDict[str, _Record] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    def wait(self, address: str, now: float) -> float:
        """Seconds ``address`` must wait before its next try is read (0: it may try now)."""
        record = self._records.get(address)
        if record is None:
            return 0.0
        if now - record.last > self.forget:
            del self._records[address]
            return 0.0
        return max(0.0, record.until - now)

    def failed(self, address: str, now: float) -> float:
        """Count a wrong token from ``address``; returns the seconds it must now wait (0 while tries are free)."""
        record = self._records.pop(address, None)
        if record is None or now - record.last > self.forget:
            record = _Record(0, now, now)
        record.failures += 1
        record.last = now
        past = record.failures - self.free
        if past > 0:
            record.until = now + min(self.cap, self.first * 2 ** min(past - 1, 32))
        self._records[address] = record  # the most recent failure last: the oldest is forgotten first
        while len(self._records) > self.addresses:
            self._records.popitem(last=False)
        return max(0.0, record.until - now)

    def failures(self, address: str) -> int:
        record = self._records.get(address)
        return record.failures if record is not None else 0

    def succeeded(self, address: str) -> None:
        """The right token from ``address``: its failures are forgotten."""
        self._records.pop(address, None)
