"""sidecar.core.tries: wrong admin tokens per address, a few free, then waits that double up to a cap; bounded."""

from __future__ import annotations

from sidecar.core import tries


def test_past_the_free_tries_each_wrong_token_doubles_the_wait_up_to_the_cap() -> None:
    t = tries.Tries(free=3, first=1.0, cap=8.0)
    now = 100.0
    waits = []
    for _ in range(8):
        assert t.wait("10.0.0.1", now) == 0.0  # the previous wait is over: the address may try
        waits.append(t.failed("10.0.0.1", now))
        now += waits[-1]
    assert waits == [0.0, 0.0, 0.0, 1.0, 2.0, 4.0, 8.0, 8.0]
    assert t.wait("10.0.0.2", now) == 0.0  # another address is not slowed by this one


def test_an_address_that_must_wait_is_told_how_long_and_the_right_token_clears_it() -> None:
    t = tries.Tries(free=1, first=2.0)
    t.failed("a", 0.0)
    assert t.failed("a", 0.0) == 2.0
    assert t.wait("a", 0.5) == 1.5
    assert t.wait("a", 2.0) == 0.0
    t.succeeded("a")
    assert t.failures("a") == 0
    assert t.failed("a", 3.0) == 0.0  # free again


def test_an_address_that_stopped_failing_long_ago_starts_afresh() -> None:
    t = tries.Tries(free=1, first=1.0, cap=60.0, forget=60.0)
    for _ in range(8):
        t.failed("a", 0.0)
    assert t.wait("a", 30.0) == 30.0
    assert t.wait("a", 61.0) == 0.0
    assert t.failed("a", 62.0) == 0.0


def test_memory_is_bounded_whatever_the_number_of_addresses() -> None:
    t = tries.Tries(free=0, addresses=100)
    for i in range(10_000):
        t.failed(f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}", float(i))
    assert len(t) == 100
    assert t.wait("10.0.39.15", 9_999.0) > 0  # the most recent are the ones kept
    assert t.failures("10.0.0.0") == 0
