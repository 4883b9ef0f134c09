"""The bench's verdicts: a slower sidecar is MISSED, not excused, and the exit status says so."""

from __future__ import annotations

import random

from bench import footprint, goals, stall

MIB = 1 << 20


def _window(round_: int, median_ms: float, seed: int) -> stall.Window:
    rng = random.Random(seed)
    gaps = [median_ms * rng.uniform(0.9, 1.1) for _ in range(400)]
    return stall.Window(round_, gaps, saves=3, save_gaps_ms=[], changes=4, pressure=None)


def _conditions(sidecar_factor: float, rounds: int = 3, disturbed_round: int | None = None) -> list[stall.Condition]:
    conds = [stall.Condition(stall.NONE), stall.Condition(stall.DIRECT), stall.Condition(stall.SIDECAR)]
    for r in range(1, rounds + 1):
        slow = 3.0 if r == disturbed_round else 1.0
        conds[0].windows.append(_window(r, 20 * slow, seed=r))
        conds[1].windows.append(_window(r, 20 * slow, seed=10 + r))
        conds[2].windows.append(_window(r, 20 * slow * sidecar_factor, seed=20 + r))
    stall.drop_disturbed(conds)
    return conds


def _stall_verdict(conds: list[stall.Condition]) -> goals.Verdict:
    (verdict,) = goals.judge(goals.Results(stalls=conds), quick=False)
    return verdict


def test_a_sidecar_that_doubles_every_gap_is_missed_and_fails_the_run() -> None:
    verdicts = goals.judge(goals.Results(stalls=_conditions(2.0)), quick=False)
    assert [v.met for v in verdicts] == [False]
    assert goals.exit_code(verdicts) == 1
    assert goals.lines(verdicts)[0].startswith("MISSED: stall")


def test_a_sidecar_that_costs_nothing_meets_the_stall_goal() -> None:
    verdict = _stall_verdict(_conditions(1.0))
    assert verdict.met is True
    assert goals.exit_code([verdict]) == 0


def test_a_round_slowed_by_the_machine_is_dropped_for_every_condition() -> None:
    conds = _conditions(1.0, disturbed_round=2)
    assert [w.kept for c in conds for w in c.windows if w.round == 2] == [False, False, False]
    assert _stall_verdict(conds).met is True


def test_footprint_is_judged_as_shares_of_the_servers_own() -> None:
    def state(sidecar_cpu: float, sidecar_rss: int) -> footprint.State:
        return footprint.State(
            "server streaming, poll 1.0 s", 1.0, 10.0, sidecar_cpu, 0.001, sidecar_rss, sidecar_rss, 1.8, 400 * MIB
        )

    light = goals.judge(goals.Results(footprint=[state(0.03, 45 * MIB)]), quick=False)
    assert [v.met for v in light] == [True, True]
    heavy = goals.judge(goals.Results(footprint=[state(0.2, 200 * MIB)]), quick=False)
    assert [v.met for v in heavy] == [False, False]
    assert goals.exit_code(heavy) == 1
