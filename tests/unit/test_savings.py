"""savings: the tokens an effective restore spared the server, priced at the server's own prefill rate."""

from __future__ import annotations

import dataclasses

import pytest

from sidecar.core import events, outcomes
from sidecar.restore import savings
from tests.unit import memllama

By = outcomes.SavedBy


def counters(tokens: float, seconds: float) -> events.Counters:
    return events.Counters(start_time=1.0, prompt_tokens=tokens, cached_tokens=0.0, prompt_seconds=seconds)


def test_the_rate_is_the_servers_own_once_it_prefilled_enough() -> None:
    assert savings.measured_rate(counters(4000, 8.0)) == 500.0
    assert savings.measured_rate(counters(savings.MIN_MEASURED_TOKENS - 1, 1.0)) is None
    assert savings.measured_rate(counters(4000, 0.0)) is None


def test_saved_tokens_are_the_reused_ones_at_most_the_restored() -> None:
    assert savings.saved_tokens(restored=4000, reused=3990.0) == 3990
    assert savings.saved_tokens(restored=4000, reused=9000.0) == 4000  # other slots' reuse is not the restore's
    assert savings.saved_tokens(restored=4000, reused=-5.0) == 0


def test_reused_tokens_are_priced_at_the_measured_rate() -> None:
    s = savings.Savings()
    s.observe(counters(4000, 8.0), memllama.IDENTITY)
    priced = s.reused(By.RESTORE, 3000)
    assert priced == savings.Priced(By.RESTORE, 3000, 6.0)
    s.reused(By.SWAP, 500)
    totals = s.totals()
    assert totals.seconds == pytest.approx(7.0)
    assert totals.tokens == 3500
    assert dict(totals.by) == {"restore": 6.0, "swap": 1.0}
    assert totals.rate == 500.0


def test_a_restarted_server_keeps_the_models_last_rate_until_it_measures_its_own() -> None:
    s = savings.Savings()
    s.observe(counters(4000, 8.0), memllama.IDENTITY)
    s.observe(counters(20, 0.5), memllama.IDENTITY)  # a new process: 20 tokens are too few to say
    assert s.totals().rate == 500.0
    s.observe(counters(1000, 1.0), memllama.IDENTITY)
    assert s.totals().rate == 1000.0
    other = dataclasses.replace(memllama.IDENTITY, model_path="/models/other.gguf")
    s.observe(counters(20, 0.5), other)  # another model: the first one's rate says nothing of it
    assert s.totals().rate is None


def test_tokens_reused_before_any_rate_wait_and_are_priced_at_the_first() -> None:
    s = savings.Savings()
    s.observe(None, memllama.IDENTITY)
    assert s.reused(By.RESTORE, 2000) is None
    assert s.totals() == savings.Totals(by=(("restore", 0.0), ("swap", 0.0)), unpriced_tokens=2000)
    assert s.observe(counters(100, 1.0), memllama.IDENTITY) == []
    assert s.observe(counters(1000, 2.0), memllama.IDENTITY) == [savings.Priced(By.RESTORE, 2000, 4.0)]
    assert s.totals().unpriced_tokens == 0
    assert s.totals().seconds == 4.0


def test_router_totals_add_up_without_a_single_rate() -> None:
    a = savings.Totals(seconds=2.0, tokens=100, by=(("restore", 2.0),), rate=50.0)
    b = savings.Totals(seconds=1.0, tokens=30, by=(("restore", 0.5), ("swap", 0.5)), rate=60.0)
    merged = savings.merge([a, b])
    assert (merged.seconds, merged.tokens, merged.rate) == (3.0, 130, None)
    assert dict(merged.by) == {"restore": 2.5, "swap": 0.5}
    assert savings.merge([a]).rate == 50.0
