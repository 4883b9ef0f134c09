"""The bench's verdicts: a slower sidecar is MISSED, not excused, and the exit status says so."""

from __future__ import annotations

import dataclasses
import json
import random

from bench import footprint, goals, hashing, hybrid_chat, price_figures, price_turns, proxy, restore, rig, stall

MIB = 1 << 20


def _window(round_: int, median_ms: float, seed: int, *, during: int = 3, after: int = 0) -> stall.Window:
    rng = random.Random(seed)
    gaps = [median_ms * rng.uniform(0.9, 1.1) for _ in range(400)]
    window = stall.Window(round_, gaps, saves=during, save_gaps_ms=[], changes=4, pressure=None)
    window.during_generation, window.after_stream = during, after
    return window


def _conditions(
    sidecar_factor: float, rounds: int = 3, disturbed_round: int | None = None, held_during: int = 0
) -> list[stall.Condition]:
    names = (stall.NONE, stall.DIRECT, stall.SIDECAR, stall.HELD)
    conds = [stall.Condition(name) for name in names]
    for r in range(1, rounds + 1):
        slow = 3.0 if r == disturbed_round else 1.0
        conds[0].windows.append(_window(r, 20 * slow, seed=r, during=0))
        conds[1].windows.append(_window(r, 20 * slow, seed=10 + r))
        conds[2].windows.append(_window(r, 20 * slow * sidecar_factor, seed=20 + r))
        conds[3].windows.append(_window(r, 20 * slow, seed=30 + r, during=held_during, after=1))
    stall.drop_disturbed(conds)
    return conds


def _stall_verdicts(conds: list[stall.Condition]) -> list[goals.Verdict]:
    return goals.judge(goals.Results(stalls=conds), quick=False)


def test_a_sidecar_that_doubles_every_gap_is_missed_and_fails_the_run() -> None:
    verdicts = _stall_verdicts(_conditions(2.0))
    assert [v.met for v in verdicts] == [False, True, True]
    assert goals.exit_code(verdicts) == 1
    assert goals.lines(verdicts)[0].startswith("MISSED: stall")


def test_a_sidecar_that_costs_nothing_meets_the_stall_goals() -> None:
    verdicts = _stall_verdicts(_conditions(1.0))
    assert [v.met for v in verdicts] == [True, True, True]
    assert goals.exit_code(verdicts) == 0


def test_a_held_save_that_lands_during_generation_is_missed() -> None:
    verdicts = _stall_verdicts(_conditions(1.0, held_during=1))
    assert [v.met for v in verdicts] == [True, True, False]
    assert goals.exit_code(verdicts) == 1


def test_a_round_slowed_by_the_machine_is_dropped_for_every_condition() -> None:
    conds = _conditions(1.0, disturbed_round=2)
    assert [w.kept for c in conds for w in c.windows if w.round == 2] == [False] * 4
    assert [v.met for v in _stall_verdicts(conds)] == [True, True, True]


def test_footprint_is_judged_as_shares_of_the_servers_own() -> None:
    def states(sidecar_cpu: float, sidecar_rss: int) -> list[footprint.State]:
        return [
            footprint.State(name, 1.0, 10.0, sidecar_cpu, 0.001, sidecar_rss, sidecar_rss, 1.8, 400 * MIB)
            for name in (footprint.STREAMING, footprint.SAVING)
        ]

    light = goals.judge(goals.Results(footprint=states(0.03, 45 * MIB)), quick=False)
    assert [v.met for v in light] == [True, True, True]
    heavy = goals.judge(goals.Results(footprint=states(0.2, 200 * MIB)), quick=False)
    assert [v.met for v in heavy] == [False, False, False]
    assert goals.exit_code(heavy) == 1


def test_a_restore_slower_than_the_servers_own_call_is_missed() -> None:
    def measure(sidecar_ms: float) -> restore.Measure:
        return restore.Measure(
            "large",
            30_000,
            200_000_000,
            direct_ms=[90.0] * 3,
            direct_server_ms=[85.0] * 3,
            restart_direct_ms=[100.0] * 3,
            restart_direct_server_ms=[90.0] * 3,
            restart_ms=[sidecar_ms] * 3,
            restart_call_ms=[95.0] * 3,
            precheck_ms=[80.0] * 3,
            demand_ms=[200.0] * 3,
            demand_wall_ms=[210.0] * 3,
            made_s=1.0,
            cached=True,
        )

    assert [v.met for v in goals.judge(goals.Results(restores=[measure(110.0)]), quick=False)] == [True]
    assert [v.met for v in goals.judge(goals.Results(restores=[measure(130.0)]), quick=False)] == [False]


def test_a_checksum_slower_than_the_disk_is_missed() -> None:
    def found(xxh3: float) -> hashing.Checksums:
        rates = {"sha256": 500.0, hashing.ALGORITHM: xxh3}
        return hashing.Checksums(200.0, rates, rates, 1000.0, "", 900.0, {hashing.CURRENT_COMMIT: (0.3, 0.04)})

    assert [v.met for v in goals.judge(goals.Results(checksums=found(2500.0)), quick=False)] == [True]
    assert [v.met for v in goals.judge(goals.Results(checksums=found(800.0)), quick=False)] == [False]


def _proxy(added_ms: float) -> proxy.Result:
    rng = random.Random(5)
    direct = [30 * rng.uniform(0.95, 1.05) for _ in range(200)]
    gaps = [
        proxy.Gaps(path, [[25 * rng.uniform(0.9, 1.1) for _ in range(300)] for _ in range(2)])
        for path in (proxy.DIRECT, proxy.PROXY)
    ]
    return proxy.Result([proxy.Latency("POST /completion", direct, [d + added_ms for d in direct], 0.0)], gaps)


def test_a_proxy_over_its_latency_target_is_missed_in_the_goals_and_fails_the_run() -> None:
    slow = goals.judge(goals.Results(proxy=_proxy(2.0)), quick=False)
    fast = goals.judge(goals.Results(proxy=_proxy(0.3)), quick=False)
    assert [v.met for v in slow] == [False, True]
    assert "2.000 ms added at p50" in slow[0].measured
    assert goals.exit_code(slow) == 1
    assert [v.met for v in fast] == [True, True]
    assert goals.exit_code(fast) == 0


def test_the_proxy_results_come_back_from_results_json() -> None:
    raw = json.loads(json.dumps(goals.Results(proxy=_proxy(2.0)).as_json()))
    again = goals.results_from_json(raw)
    assert again.proxy == _proxy(2.0)


def _hybrid(*, proxy_reuse: int, proxy_ms: float) -> hybrid_chat.Result:
    """Two chats, two turns each and one after the kill -9, on one model in the three modes."""

    def run(mode: str, reuse: int, ms: float) -> hybrid_chat.Run:
        turns = [hybrid_chat.Turn(c, t, ms if t > 1 else 500.0, reuse if t > 1 else 0, 1000 * t, 1000 * (t - 1))
                 for t in (1, 2) for c in (0, 1)]  # fmt: skip
        after = [hybrid_chat.Turn(1, 3, ms, reuse * 2, 3000, 2000), hybrid_chat.Turn(0, 3, ms, reuse * 2, 3000, 2000)]
        return hybrid_chat.Run("qwen35", mode, turns, after)

    return hybrid_chat.Result(1000, [run(hybrid_chat.ALONE, 995, 40.0), run(hybrid_chat.BESIDE, 995, 41.0),
                                run(hybrid_chat.PROXY, proxy_reuse, proxy_ms)])  # fmt: skip


def test_hybrid_turns_that_reuse_nothing_through_the_proxy_are_missed_and_fail_the_run() -> None:
    good = goals.judge(goals.Results(hybrid=_hybrid(proxy_reuse=990, proxy_ms=45.0)), quick=True)
    assert [v.met for v in good] == [True] * 5, good
    assert goals.exit_code(good) == 0
    cold = goals.judge(goals.Results(hybrid=_hybrid(proxy_reuse=0, proxy_ms=45.0)), quick=True)
    missed = [v.goal for v in cold if v.met is False]
    assert len(missed) == 2, missed
    assert all("through the proxy" in g for g in missed), missed
    assert goals.exit_code(cold) == 1


def test_hybrid_turns_slower_than_llama_server_alone_are_missed() -> None:
    slow = goals.judge(goals.Results(hybrid=_hybrid(proxy_reuse=990, proxy_ms=60.0)), quick=True)
    missed = [v for v in slow if v.met is False]
    assert len(missed) == 1, missed
    assert "time to first token proxy" in missed[0].goal
    assert "1.50x" in missed[0].measured


def test_a_quick_run_whose_rounds_straddle_the_bar_gives_no_verdict() -> None:
    # The case: 1.020x against a 1.02x bar, with rounds further apart than the margin.
    assert rig.decide(1.020, 1.02, rounds=[1.00, 1.05], quick=True) is None
    assert rig.decide(1.020, 1.02, rounds=[1.00, 1.05], quick=False) is True  # the full run decides
    assert rig.decide(1.30, 1.02, rounds=[1.28, 1.31], quick=True) is False  # rounds agree: a miss is a miss
    assert rig.decide(0.90, 1.02, rounds=[0.89, 0.92], quick=True) is True
    assert rig.decide(0.90, 1.02, rounds=[0.9], quick=True) is None  # one round cannot show its spread


def test_a_quick_stall_run_of_one_round_is_split_in_halves_to_decide() -> None:
    near = goals.judge(goals.Results(stalls=_conditions(1.02, rounds=1)), quick=True)
    far = goals.judge(goals.Results(stalls=_conditions(2.0, rounds=1)), quick=True)
    assert near[0].met is None, near[0].measured  # at the bar: the halves differ by more than the margin
    assert "per round" in near[0].measured
    assert goals.judge(goals.Results(stalls=_conditions(1.02, rounds=1)), quick=False)[0].met is not None
    assert far[0].met is False  # twice the gaps: both halves say so
    assert goals.exit_code(far) == 1


def _price(*, turn_ms: float, first_ms: float, crashed_ms: float, quick: bool = False) -> price_figures.Result:
    rng = random.Random(7)

    def around(value: float, n: int = 12) -> list[float]:
        return [value * rng.uniform(0.99, 1.01) for _ in range(n)]

    apis = [
        price_figures.Api(
            name,
            {price_figures.DIRECT: around(200.0), price_figures.PROXY: around(turn_ms)},
            {price_figures.DIRECT: around(100.0), price_figures.PROXY: around(first_ms)},
            5000.0,
        )
        for name in price_turns.APIS
    ]
    direct = around(1.0, 100)
    non_routed = [proxy.Latency("POST /tokenize", direct, [d + 0.4 for d in direct], 500.0)]
    crash = price_figures.Crash(2000, around(crashed_ms, 3), around(200.0, 3), [2000] * 3, [2000] * 3)
    return price_figures.Result(2000, apis, non_routed, crash, quick)


def test_the_proxys_price_goals_are_met_or_missed_and_fail_the_run() -> None:
    cheap = goals.judge(goals.Results(price=_price(turn_ms=202.0, first_ms=101.0, crashed_ms=220.0)), quick=False)
    dear = goals.judge(goals.Results(price=_price(turn_ms=240.0, first_ms=120.0, crashed_ms=300.0)), quick=False)
    assert [v.met for v in cheap] == [True] * len(cheap)
    assert goals.exit_code(cheap) == 0
    by = {v.goal.split(",")[0] if "," in v.goal else v.goal: v.met for v in dear}
    assert by["price: chat completions"] is False
    assert [v.met for v in dear if "kill -9" in v.goal] == [False]
    assert [v.met for v in dear if "non-routed" in v.goal] == [True]
    assert goals.exit_code(dear) == 1


def test_a_crashed_turn_that_reused_nothing_gets_no_verdict_and_the_results_come_back_from_json() -> None:
    result = _price(turn_ms=202.0, first_ms=101.0, crashed_ms=220.0)
    cold = dataclasses.replace(result, crash=dataclasses.replace(result.crash, cache_n=[0, 0, 0]))
    [crash] = [v for v in goals.judge(goals.Results(price=cold), quick=False) if "kill -9" in v.goal]
    assert crash.met is None  # the restore did not serve it: the ratio measures something else
    raw = json.loads(json.dumps(goals.Results(price=result).as_json()))
    assert goals.results_from_json(raw).price == result


def test_the_proxys_price_is_taken_per_pair_and_per_order_not_from_one_median_over_both_orders() -> None:
    """The way sent second pays ~17 ms of the server's work after the first; the server drifts over the run.

    A proxy that adds 1 ms: each pair's difference is +1 +- 17 ms by its order, over a server whose own
    time climbs from 100 to 190 ms. One median over the pairs of both orders reads one order's +18 or
    -16 ms; the mean of the two orders' medians reads the proxy's +1 ms.
    """
    direct, proxied = [], []
    for i in range(31):
        base = 100.0 + 3.0 * i
        direct.append(base)
        proxied.append(base + 1.0 + (17.0 if i % 2 else -17.0))  # odd pairs: the proxy's turn went second
    same = {price_figures.DIRECT: direct, price_figures.PROXY: direct}
    streamed = price_figures.Api(
        "chat completions", same, {price_figures.DIRECT: direct, price_figures.PROXY: proxied}, 0.0
    )
    assert abs(streamed.added() - 1.0) < 1e-9
    assert rig.median([p - d for d, p in zip(direct, proxied, strict=True)]) in (18.0, -16.0)
    assert streamed.ratio() == 1.0  # its non-streamed turns: the same both ways
    turns = price_figures.Api(
        "chat completions", {price_figures.DIRECT: direct, price_figures.PROXY: proxied}, same, 0.0
    )
    ratios = [p / d for d, p in zip(direct, proxied, strict=True)]
    assert turns.ratio() == (rig.median(ratios[0::2]) + rig.median(ratios[1::2])) / 2
    assert abs(turns.ratio() - 1.0) < 0.01


def test_the_first_byte_with_the_servers_compute_taken_out_is_paired_and_not_read_from_an_older_run() -> None:
    """Each streamed turn less the server's compute for it: the server's swing cancels, the proxy's 2 ms stays."""
    rng = random.Random(3)
    compute = [400.0 + rng.uniform(-50.0, 50.0) for _ in range(30)]  # the server's own, per turn
    direct = [c + 80.0 for c in compute]
    proxied = [c + 82.0 + rng.uniform(-40.0, 40.0) for c in compute]  # its compute swings on its own as well
    outside = {
        price_figures.DIRECT: [d - c for d, c in zip(direct, compute, strict=True)],
        price_figures.PROXY: [82.0] * 30,
    }
    api = price_figures.Api("responses", {}, {price_figures.DIRECT: direct, price_figures.PROXY: proxied}, 0.0, outside)
    assert api.outside() == 2.0
    assert abs(api.added() - 2.0) > 1.0  # the swing the diagnostic takes out
    older = price_figures.Api("responses", {}, {price_figures.DIRECT: direct, price_figures.PROXY: proxied}, 0.0)
    assert older.outside() != older.outside()  # NaN: a results.json from before the column says nothing


def test_a_proxied_turn_of_the_same_work_is_judged_with_the_direct_turns_compute_and_one_of_more_work_as_measured() -> (
    None
):
    """The server's compute swings per turn by ±50 ms on its own; the proxy adds 1.5 ms outside it.

    Where the server processed the same prompt tokens both ways, the goal's figure reads the proxy's 1.5 ms;
    a proxied turn that made the server process 200 tokens more keeps its own (longer) compute.
    """
    rng = random.Random(11)
    n = 30
    direct_compute = [150.0 + rng.uniform(-50.0, 50.0) for _ in range(n)]
    proxy_compute = [150.0 + rng.uniform(-50.0, 50.0) for _ in range(n)]
    direct = [c + 20.0 for c in direct_compute]
    proxied = [c + 21.5 for c in proxy_compute]
    same = {price_figures.DIRECT: [40] * n, price_figures.PROXY: [40 + price_figures.SAME_WORK_TOKENS] * n}
    compute = {price_figures.DIRECT: direct_compute, price_figures.PROXY: proxy_compute}
    ms = {price_figures.DIRECT: direct, price_figures.PROXY: proxied}
    outside = {way: [t - c for t, c in zip(ms[way], compute[way], strict=True)] for way in ms}
    api = price_figures.Api("chat completions", ms, ms, 0.0, outside, compute, same, same)
    assert abs(api.first_added() - 1.5) < 1e-9
    plus = {price_figures.DIRECT: direct, price_figures.PROXY: [d + 1.5 for d in direct]}
    assert abs(api.turn_ratio() - price_figures._paired(plus, slice(None), price_figures._ratio)) < 1e-12
    assert abs(api.added() - 1.5) > 2.0  # as measured, the server's swing buries the proxy's 1.5 ms
    assert api.different_work() == 0
    more = {price_figures.DIRECT: [40] * n, price_figures.PROXY: [40] * (n - 1) + [240]}
    heavier = price_figures.Api("chat completions", ms, ms, 0.0, outside, compute, more, more)
    assert price_figures._swapped(ms, compute, more)[-1] == proxied[-1]  # kept as measured
    assert price_figures._swapped(ms, compute, more)[0] == direct[0] + 1.5
    assert heavier.different_work() == 2  # one pair of each kind
    result = dataclasses.replace(_price(turn_ms=202.0, first_ms=101.0, crashed_ms=220.0), apis=[api])
    back = goals.results_from_json(json.loads(json.dumps(goals.Results(price=result).as_json()))).price
    assert back is not None
    assert back.apis == [api]
