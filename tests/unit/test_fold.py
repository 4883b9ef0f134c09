"""fold.Fold (pure) and logfold.Folding: repeated log lines of one kind are one line and a count per interval."""

from __future__ import annotations

import logging

import pytest
import structlog
from hypothesis import given
from hypothesis import strategies as st

from sidecar.core import fold, logfold


def test_the_first_of_a_kind_is_logged_the_rest_counted_and_summarised_once_the_interval_ends() -> None:
    folding = fold.Fold(10.0)
    assert folding.offer("a", 0.0)
    assert [folding.offer("a", t) for t in (1.0, 2.0, 9.9)] == [False, False, False]
    assert folding.offer("b", 5.0), "another kind has an interval of its own"
    assert folding.due(9.9) == []
    assert folding.due(10.0) == [fold.Folded("a", 3, 10.0)]
    assert folding.due(15.0) == [], "b folded nothing: no summary"
    assert folding.offer("a", 11.0), "a new interval: its first line is logged again"


def test_a_line_after_its_interval_ended_keeps_the_old_count_for_the_summary() -> None:
    folding = fold.Fold(10.0)
    folding.offer("a", 0.0)
    folding.offer("a", 1.0)
    assert folding.offer("a", 12.0)  # no due() was asked in between
    assert not folding.offer("a", 13.0)
    assert folding.due(14.0) == [fold.Folded("a", 1, 10.0)]
    assert folding.due(22.0) == [fold.Folded("a", 1, 10.0)]


def test_past_the_kinds_it_follows_a_new_kind_is_not_folded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fold, "MAX_KINDS", 2)
    folding = fold.Fold(10.0)
    assert folding.offer("a", 0.0)
    assert folding.offer("b", 0.0)
    assert folding.offer("c", 1.0)
    assert folding.offer("c", 1.0)
    assert not folding.offer("a", 1.0)


@given(st.lists(st.tuples(st.sampled_from("abc"), st.floats(0, 5, allow_nan=False)), max_size=200))
def test_every_line_is_either_logged_or_counted_in_one_summary(lines: list[tuple[str, float]]) -> None:
    folding = fold.Fold(1.0)
    now, logged, summarised = 0.0, 0, 0
    for kind, step in lines:
        now += step
        logged += folding.offer(kind, now)
        summarised += sum(f.count for f in folding.due(now))
    summarised += sum(f.count for f in folding.due(float("inf")))
    assert logged + summarised == len(lines)
    assert logged <= len(lines)


def test_stdlib_records_and_per_request_warnings_are_folded_and_summarised() -> None:
    now = [0.0]
    folding = logfold.Folding(every=10.0, clock=lambda: now[0])
    record = logging.LogRecord("aiohttp.server", logging.ERROR, "", 0, "Error handling request from %s", ("x",), None)
    quiet = logging.LogRecord("aiohttp.access", logging.INFO, "", 0, "%s", ("x",), None)
    assert [folding.filter(record) for _ in range(100)].count(True) == 1
    assert all(folding.filter(quiet) for _ in range(5)), "below WARNING: not folded"
    event = {"event": "proxy_answer_cut"}
    assert folding.processor(None, "warning", dict(event)) == event
    with pytest.raises(structlog.DropEvent):
        folding.processor(None, "warning", dict(event))
    assert folding.processor(None, "warning", {"event": "snapshot_failed"}), "not a per-request warning"
    with structlog.testing.capture_logs() as lines:
        now[0] = 10.0
        assert folding.summarise() == 2
    by_kind = {entry["kind"]: entry for entry in lines}
    assert by_kind["aiohttp.server: Error handling request from %s"]["lines"] == 99
    assert by_kind["proxy_answer_cut"]["lines"] == 1
    assert "were not written" in by_kind["proxy_answer_cut"]["effect"]
