"""stallweigh.weigh: whether a save past its hold is worth the stall it costs every slot."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.save import stallweigh

W = stallweigh.Weight
PACE = 0.4 / 1000
"""Seconds per token of a save: 0.4 s per 1,000 tokens, an 8B-class KV."""
RATE = 400.0
"""Prefill tokens per second."""


@pytest.mark.parametrize(
    ("tail", "rate", "pace", "bound", "weight"),
    [
        (4, RATE, PACE, 10.0, W.CHEAPER_THAN_STALL),  # 0.01 s of re-prefill against a 1.2 s stall: held
        (480, RATE, PACE, 10.0, W.WORTH_ITS_STALL),  # 1.2 s against 1.2 s: saved
        (2000, RATE, PACE, 10.0, W.WORTH_ITS_STALL),
        (4, 1.0, PACE, 3.0, W.OVER_BOUND),  # 4 s of re-prefill, past a bound of 3 s, though the stall is 1.2 s
        (4, RATE, PACE, 0.0, W.OFF),  # --max-unsaved-seconds 0: never weighed
        (4, None, PACE, 10.0, W.UNMEASURED),  # no prefill rate yet
        (4, RATE, None, 10.0, W.UNMEASURED),  # no save measured yet
        (4, 0.0, PACE, 10.0, W.UNMEASURED),
    ],
    ids=["cheap tail", "tail equal to the stall", "dear tail", "over the bound", "off", "no rate", "no pace", "rate 0"],
)
def test_a_save_past_its_hold_is_made_unless_its_tail_re_prefills_faster_than_it_stalls(
    tail: int, rate: float | None, pace: float | None, bound: float, weight: stallweigh.Weight
) -> None:
    weighing = stallweigh.weigh(tokens=3000, tail=tail, rate=rate, pace=pace, bound=bound)
    assert weighing.weight is weight
    assert weighing.save is (weight is not W.CHEAPER_THAN_STALL)
    assert weighing.stall == (None if pace is None else pytest.approx(3000 * pace))
    assert weighing.reprefill == (None if not rate else pytest.approx(tail / rate))


def test_the_figures_of_an_empty_tail_and_an_empty_slot_are_zero() -> None:
    assert stallweigh.reprefill_seconds(0, RATE) == 0
    assert stallweigh.reprefill_seconds(-5, RATE) == 0
    assert stallweigh.stall_seconds(0, PACE) == 0
    assert stallweigh.reprefill_seconds(10, None) is None
    assert stallweigh.stall_seconds(10, None) is None


@given(
    tokens=st.integers(0, 200_000),
    tail=st.integers(0, 200_000),
    rate=st.one_of(st.none(), st.floats(0.0, 1e5)),
    pace=st.one_of(st.none(), st.floats(0.0, 1e-2)),
    bound=st.floats(0.0, 600.0),
)
def test_a_held_save_never_leaves_a_tail_dearer_than_its_stall_or_the_bound(
    tokens: int, tail: int, rate: float | None, pace: float | None, bound: float
) -> None:
    weighing = stallweigh.weigh(tokens=tokens, tail=tail, rate=rate, pace=pace, bound=bound)
    if not weighing.save:
        assert weighing.reprefill is not None
        assert weighing.stall is not None
        assert weighing.reprefill < weighing.stall
        assert weighing.reprefill <= bound
        assert bound > 0
