"""bench.swa's figures: the rewind's cost at 8B-class KV, in seconds and as a share of the turns' time."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

from bench import swa


def _turn(ttft_ms: float) -> Any:
    """What the section reads of a turn (``bench``'s ``Turn``)."""
    return cast(Any, SimpleNamespace(ttft_ms=ttft_ms, cache_n=1520, previous=1523, reuse=1520 / 1523))


def _trial(model: str, rewind_s: float, turns_ms: float) -> swa.Trial:
    return swa.Trial(model, _turn(1000.0), _turn(1100.0), rewind_s, turns_ms)


def test_the_rewind_at_8b_class_kv_is_reported_in_seconds_and_as_a_share_of_the_turns_time() -> None:
    trials = [
        _trial("gemma3-270m", 9.0, 1000.0),  # another model's rewinds are not counted
        _trial(swa.WIDE, 0.5, 10_000.0),
        _trial(swa.WIDE, 0.7, 10_000.0),
        _trial(swa.WIDE, 0.6, 5_000.0),
    ]
    line = swa.rewind_cost(trials)
    assert "0.60 s" in line, line  # the median of 0.5, 0.6, 0.7
    assert "7.0%" in line, line  # the median of 5%, 7%, 12%
    assert "3 trials" in line
    assert line in swa.verdicts(trials)[-1]
    assert swa.table(trials).count("REPORT") == 1


def test_no_trial_of_the_wide_model_says_so() -> None:
    assert "no trial" in swa.rewind_cost([_trial("gemma3-270m", 0.1, 1000.0)])


def test_unknown_models_are_refused_with_the_choices() -> None:
    assert swa.main(["--models", "llama9"]) == 2
