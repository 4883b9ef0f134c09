"""The library bench's verdicts at llama-server's defaults: the price of a turn, and every conversation warm after
the kill -9 through the proxy (llama-server alone reported beside, not judged)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from bench import library, library_paths


def _run(
    path: str, turn: float, after: list[float], *, way: str = "", prefill: list[float] | None = None
) -> library_paths.Run:
    """Two rounds of every conversation (the first one cold), then the turn after the kill -9 of each.

    ``prefill``: each of those turns' re-prefill in seconds (default: 0.05 s where it reused anything, else 30 s).
    """
    n = len(after)
    return library_paths.Run(
        n,
        path,
        [[2.0] * n, [turn] * n],
        way=way,
        after_kill=after,
        after_kill_seconds=[0.1 if a else 3.0 for a in after],
        after_kill_prefill=prefill if prefill is not None else [0.05 if a else 30.0 for a in after],
    )


def _point(
    proxy_turn: float, proxy_after: list[float], *, way: str = library_paths.WHOLE, prefill: list[float] | None = None
) -> library_paths.Point:
    n = len(proxy_after)
    direct = _run(library_paths.DIRECT, 1.0, [0.0] * n)
    return library_paths.Point(
        n, direct, _run(library_paths.PROXY, proxy_turn, proxy_after, way=way, prefill=prefill), ram=True
    )


def _kill_line(point: library_paths.Point, *, kind: str = "goal") -> str:
    """The kill -9 verdict (``goal``: MET or MISSED) or its ``report`` line."""
    lines = [line for line in library.verdicts([point]) if "after a kill -9" in line or "after the kill -9" in line]
    assert len(lines) == 2, lines
    return lines[0] if kind == "goal" else lines[1]


def test_every_conversation_warm_through_the_proxy_meets_the_goal_and_says_llama_server_alone_beside() -> None:
    line = _kill_line(_point(1.0, [1.0, 0.995, 0.99, 1.0, 1.0, 1.0]))
    assert line.startswith("MET ")
    assert "6 of 6" in line
    assert "llama-server alone 0 of 6 at 99%, median turn 3.000 s" in line


def test_one_conversation_below_99_percent_after_the_kill_past_the_bound_misses_the_goal() -> None:
    point = _point(1.0, [1.0, 1.0, 0.92, 1.0, 1.0, 1.0], prefill=[0.05, 0.05, 10.5, 0.05, 0.05, 0.05])
    line = _kill_line(point)
    assert line.startswith("MISSED ")
    assert "5 of 6 (longest re-prefill 10.50 s)" in line
    assert "--max-unsaved-seconds 10" in line
    assert point.proxy.warm_after_kill == 5
    assert "5 of 6 reused at least 99%" in _kill_line(point, kind="report")
    assert "(lowest 92.0%" in _kill_line(point, kind="report")


def test_a_conversation_that_left_unsaved_within_the_bound_meets_the_goal_and_the_share_is_reported() -> None:
    point = _point(1.0, [1.0, 1.0, 0.92, 1.0, 1.0, 1.0], prefill=[0.05, 0.05, 1.5, 0.05, 0.05, 0.05])
    assert _kill_line(point).startswith("MET ")
    assert "6 of 6 (longest re-prefill 1.50 s)" in _kill_line(point)
    report = _kill_line(point, kind="report")
    assert report.startswith("REPORT ")
    assert "5 of 6 reused at least 99%" in report


def test_a_bound_of_zero_leaves_only_the_share() -> None:
    proxy = library_paths.Run(3, library_paths.PROXY, [[2.0] * 3, [1.0] * 3], way=library_paths.WHOLE,
                              after_kill=[1.0, 0.92, 1.0], after_kill_seconds=[0.1] * 3,
                              after_kill_prefill=[0.05, 0.4, 0.05], bound=0.0)  # fmt: skip
    line = _kill_line(library_paths.Point(3, _run(library_paths.DIRECT, 1.0, [0.0] * 3), proxy, ram=True))
    assert line.startswith("MISSED ")
    assert "2 of 3" in line


def test_the_price_at_the_defaults_is_judged_beside_the_kill_and_each_way_on_its_own() -> None:
    whole = _point(1.02, [1.0] * 6)
    blocks = _point(1.05, [1.0] * 6, way=library_paths.BLOCKS)
    lines = library.verdicts([whole, blocks])
    assert [line.split()[0] for line in lines] == ["MET", "MET", "REPORT", "MISSED", "MET", "REPORT"]
    assert "whole files, N=6:" in lines[0]
    assert "block store, N=6" in lines[3]
    assert "(1.050x;" in lines[3]


def test_the_price_at_the_defaults_is_the_median_of_each_turns_ratio_to_the_same_turn_alone() -> None:
    """Turns far apart in length: three pairs 1% apart and one 10%, the medians of the two paths 5.5% apart."""
    direct = library_paths.Run(4, library_paths.DIRECT, [[2.0] * 4, [1.0, 2.0, 2.0, 3.0]])
    proxy = library_paths.Run(4, library_paths.PROXY, [[2.0] * 4, [1.01, 2.02, 2.2, 3.03]])
    point = library_paths.Point(4, direct, proxy, ram=True)
    assert point.paired_price == pytest.approx(1.01)
    assert 1 / point.speedup == pytest.approx(1.055)
    (line,) = library.verdicts([point])
    assert line.startswith("MET ")
    assert "(1.010x; the ratio of the two medians 1.055x)" in line
    slower = library_paths.Run(4, library_paths.PROXY, [[2.0] * 4, [1.05, 2.1, 2.1, 3.15]])
    (line,) = library.verdicts([library_paths.Point(4, direct, slower, ram=True)])
    assert line.startswith("MISSED ")


def test_without_a_kill_round_there_is_no_kill_verdict() -> None:
    direct = library_paths.Run(6, library_paths.DIRECT, [[2.0] * 6, [1.0] * 6])
    proxy = library_paths.Run(6, library_paths.PROXY, [[2.0] * 6, [0.5] * 6])
    lines = library.verdicts([library_paths.Point(6, direct, proxy, ram=False)])
    assert len(lines) == 1
    assert lines[0].startswith("MET  library beats llama-server alone")


def test_the_table_at_the_defaults_shows_both_paths_warm_after_the_kill_and_the_sidecars_counters() -> None:
    point = _point(1.0, [1.0, 0.5, 1.0])
    proxy = library_paths.Run(
        3, library_paths.PROXY, point.proxy.rounds, way=library_paths.WHOLE, after_kill=point.proxy.after_kill,
        after_kill_seconds=point.proxy.after_kill_seconds, figures={"left unsaved": 2.0, "left unsaved end": 2.0},
    )  # fmt: skip
    text = library.table([library_paths.Point(3, point.direct, proxy, ram=True)], tokens=1000)
    assert "0/3" in text
    assert "2/3" in text
    assert "2/2" in text
    assert "--cache-ram 0" not in text


def test_the_options_pick_models_and_ways_by_name_and_refuse_others() -> None:
    _, choice = library.parse(["--defaults-only", "--models", "wide", "--ways", "blocks", "--conversations", "6,20"])
    assert choice == library.Choice(
        (6, 20), True, (library_paths.WIDE,), (library_paths.BLOCKS,), library_paths.STAGING, ""
    )
    _, default = library.parse([])
    assert default.ways == (library_paths.WHOLE, library_paths.BLOCKS)
    assert not default.defaults_only
    with pytest.raises(argparse.ArgumentTypeError):
        library._names("tiny,huge", library.MODELS)


def test_the_two_llama_servers_of_a_pair_run_with_slot_dirs_named_at_one_length() -> None:
    """Command lines one byte apart put 1.5-3.5% between the two servers' own prompt times (``library_paths.TAGS``)."""
    alone = library_paths.Plan(20, 400, 3, ram=True)
    names = {
        way: library_paths.slot_name(dataclasses.replace(alone, way=way))
        for way in ("", library_paths.WHOLE, library_paths.BLOCKS)
    }
    assert len({len(name) for name in names.values()}) == 1, names
    assert len(set(names.values())) == 3, names
