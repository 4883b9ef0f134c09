"""The library bench's verdicts at llama-server's defaults: the price of a turn, and every conversation warm after
the kill -9 through the proxy (llama-server alone reported beside, not judged)."""

from __future__ import annotations

import argparse

import pytest

from bench import library


def _run(path: str, turn: float, after: list[float], *, way: str = "") -> library.Run:
    """Two rounds of every conversation (the first one cold), then the turn after the kill -9 of each."""
    n = len(after)
    return library.Run(
        n,
        path,
        [[2.0] * n, [turn] * n],
        way=way,
        after_kill=after,
        after_kill_seconds=[0.1 if a else 3.0 for a in after],
    )


def _point(proxy_turn: float, proxy_after: list[float], *, way: str = library.WHOLE) -> library.Point:
    n = len(proxy_after)
    direct = _run(library.DIRECT, 1.0, [0.0] * n)
    return library.Point(n, direct, _run(library.PROXY, proxy_turn, proxy_after, way=way), ram=True)


def _kill_line(point: library.Point) -> str:
    lines = [line for line in library.verdicts([point]) if "after a kill -9" in line]
    assert len(lines) == 1, lines
    return lines[0]


def test_every_conversation_warm_through_the_proxy_meets_the_goal_and_says_llama_server_alone_beside() -> None:
    line = _kill_line(_point(1.0, [1.0, 0.995, 0.99, 1.0, 1.0, 1.0]))
    assert line.startswith("MET ")
    assert "6 of 6" in line
    assert "llama-server alone 0 of 6, 3.000 s" in line


def test_one_conversation_below_99_percent_after_the_kill_misses_the_goal() -> None:
    point = _point(1.0, [1.0, 1.0, 0.92, 1.0, 1.0, 1.0])
    line = _kill_line(point)
    assert line.startswith("MISSED ")
    assert "5 of 6 (lowest 92.0%)" in line
    assert point.proxy.warm_after_kill == 5


def test_the_price_at_the_defaults_is_judged_beside_the_kill_and_each_way_on_its_own() -> None:
    whole = _point(1.02, [1.0] * 6)
    blocks = _point(1.05, [1.0] * 6, way=library.BLOCKS)
    lines = library.verdicts([whole, blocks])
    assert [line.split()[0] for line in lines] == ["MET", "MET", "MISSED", "MET"]
    assert "whole files, N=6:" in lines[0]
    assert "block store, N=6" in lines[2]
    assert "(1.050x)" in lines[2]


def test_without_a_kill_round_there_is_no_kill_verdict() -> None:
    direct = library.Run(6, library.DIRECT, [[2.0] * 6, [1.0] * 6])
    proxy = library.Run(6, library.PROXY, [[2.0] * 6, [0.5] * 6])
    lines = library.verdicts([library.Point(6, direct, proxy, ram=False)])
    assert len(lines) == 1
    assert lines[0].startswith("MET  library beats llama-server alone")


def test_the_table_at_the_defaults_shows_both_paths_warm_after_the_kill_and_the_sidecars_counters() -> None:
    point = _point(1.0, [1.0, 0.5, 1.0])
    proxy = library.Run(
        3, library.PROXY, point.proxy.rounds, way=library.WHOLE, after_kill=point.proxy.after_kill,
        after_kill_seconds=point.proxy.after_kill_seconds, figures={"left unsaved": 2.0, "left unsaved end": 2.0},
    )  # fmt: skip
    text = library.table([library.Point(3, point.direct, proxy, ram=True)], tokens=1000)
    assert "0/3" in text
    assert "2/3" in text
    assert "2/2" in text
    assert "--cache-ram 0" not in text


def test_the_options_pick_models_and_ways_by_name_and_refuse_others() -> None:
    _, choice = library.parse(["--defaults-only", "--models", "wide", "--ways", "blocks", "--conversations", "6,20"])
    assert choice == library.Choice((6, 20), True, (library.WIDE,), (library.BLOCKS,), library.STAGING, "")
    _, default = library.parse([])
    assert default.ways == (library.WHOLE, library.BLOCKS)
    assert not default.defaults_only
    with pytest.raises(argparse.ArgumentTypeError):
        library._names("tiny,huge", library.MODELS)
