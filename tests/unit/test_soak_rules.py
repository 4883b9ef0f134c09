"""The soak's pure parts: its seeded schedule, what a turn proves, and its report's verdicts."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.soak import invariants, report, schedule

KILL = schedule.Fault.SERVER_KILL


def test_a_seed_gives_the_same_schedule_and_another_seed_another() -> None:
    assert schedule.plan(7, 600) == schedule.plan(7, 600)
    assert schedule.plan(7, 600) != schedule.plan(8, 600)


@given(seed=st.integers(0, 10**6), seconds=st.floats(min_value=60, max_value=7200))
def test_the_schedule_keeps_its_warm_up_settle_gaps_and_lasting_faults_apart(seed: int, seconds: float) -> None:
    events = schedule.plan(seed, seconds)
    assert all(schedule.WARM_UP <= e.at <= seconds - schedule.SETTLE for e in events)
    assert [e.at for e in events] == sorted(e.at for e in events)
    process = [e.at for e in events if e.fault in schedule.PROCESS]
    assert all(b - a >= schedule.PROCESS_GAP - 0.02 for a, b in itertools.pairwise(process))
    for fault in schedule.LASTING:
        spans = [(e.at, e.at + e.seconds) for e in events if e.fault is fault]
        assert all(e2[0] >= e1[1] - 0.02 for e1, e2 in itertools.pairwise(spans))
        assert all(end <= seconds - schedule.SETTLE + 0.02 for _, end in spans)
    assert all((e.seconds > 0) == (e.fault in schedule.LASTING) or e.seconds == 0 for e in events)


def test_an_hour_has_every_kind_of_fault_and_over_two_hundred_of_them() -> None:
    events = schedule.plan(1, 3600)
    assert len(events) >= 200
    assert all(n > 0 for n in schedule.counts(events).values())


@given(seed=st.integers(0, 10**6), seconds=st.floats(min_value=60, max_value=7200))
def test_no_fault_ends_the_sidecar_in_the_steady_stretch(seed: int, seconds: float) -> None:
    events = schedule.plan(seed, seconds)
    assert all(e.at < schedule.own_until(seconds) for e in events if e.fault in schedule.OWN)
    assert schedule.own_until(seconds) <= schedule.steady_from(seconds)


def test_an_hour_keeps_one_sidecar_process_for_its_last_forty_minutes_and_still_has_every_fault_kind() -> None:
    events = schedule.plan(7, 3600)
    assert schedule.steady_from(3600) == pytest.approx(1200)
    assert max(e.at for e in events if e.fault in schedule.OWN) < 1200 - schedule.OWN_SETTLE, (
        "the process judged has started 3 minutes before the stretch"
    )
    assert schedule.own_until(120) == schedule.steady_from(120), "a short run (CI's) keeps its schedule"
    assert len(events) >= 200
    assert all(n > 0 for n in schedule.counts(events).values())
    assert any(e.fault is schedule.Fault.SERVER_KILL and e.at > 3000 for e in events)


def test_rss_growth_is_read_over_the_one_process_that_lived_through_the_steady_stretch() -> None:
    samples = [(10.0, 1, 50.0), (1190.0, 2, 60.0), (1205.0, 3, 70.0), (2400.0, 3, 74.0), (3590.0, 3, 77.0)]
    assert invariants.rss_growth(samples, 1200.0) == 77.0 / 70.0
    restarted = [*samples, (3595.0, 4, 40.0)]
    assert invariants.rss_growth(restarted, 1200.0) is None, "a process that started late says nothing"
    assert invariants.rss_growth(samples[:2], 1200.0) is None


def test_rss_growth_is_judged_over_a_long_steady_stretch_only() -> None:
    hour = figures(minutes=60, rss_growth=1.12)
    assert [name for name, ok in report.verdicts(hour).items() if not ok] == [
        "RSS growth at most 10% over the last 40 minutes"
    ]
    assert all(report.verdicts(figures(minutes=60, rss_growth=1.08)).values())
    assert not all(report.verdicts(figures(minutes=60, rss_growth=None)).values()), "no figure is no pass"
    assert all(report.verdicts(figures(minutes=2, rss_growth=1.5)).values()), "two minutes: caches filling"


def done(*pairs: tuple[float, int]) -> list[invariants.Done]:
    return [invariants.Done(ended, prompt) for ended, prompt in pairs]


def test_a_turn_that_reuses_its_previous_prompt_is_warm_and_a_first_turn_is_first() -> None:
    assert invariants.classify([], started=1, cached=0, windows=[], allowance=8) is invariants.Verdict.FIRST
    before = done((10, 1000))
    assert invariants.classify(before, started=20, cached=990, windows=[], allowance=8) is invariants.Verdict.WARM
    assert invariants.classify(before, started=20, cached=-1, windows=[], allowance=8) is invariants.Verdict.UNKNOWN


def test_a_cold_turn_after_a_kill_is_allowed_only_for_the_turns_within_the_allowance() -> None:
    before = done((10, 1000), (30, 1200))
    kill = [invariants.Window(KILL, 35, 35)]
    # the turn that ended 5 s before the kill may be lost, the one 25 s before may not
    assert invariants.classify(before, started=40, cached=995, windows=kill, allowance=8) is (
        invariants.Verdict.COLD_UNSAVED
    )
    assert invariants.classify(before, started=40, cached=300, windows=kill, allowance=8) is invariants.Verdict.LOST
    sigterm = [invariants.Window(schedule.Fault.SIGTERM, 35, 35)]
    assert invariants.classify(before, started=40, cached=1195, windows=sigterm, allowance=8) is (
        invariants.Verdict.WARM  # a SIGTERM saves every slot first
    )
    assert invariants.classify(before, started=40, cached=995, windows=sigterm, allowance=8) is (
        invariants.Verdict.COLD_RAM  # but not llama-server's RAM cache, where a turn may have left unsaved
    )
    assert invariants.classify(before, started=40, cached=300, windows=sigterm, allowance=8) is (
        invariants.Verdict.LOST
    )


def test_a_kill_while_the_turn_was_under_way_counts_as_one_before_it() -> None:
    """Sent just before a ``kill -9`` and sent again by the proxy after the restart: its answer's reuse is what the
    restore brought back, so the kill may cost it the turns that ended within the allowance before the kill."""
    before = done((15, 472), (38.8, 538))
    kill = [invariants.Window(KILL, 40, 40)]
    assert invariants.classify(before, started=39.5, ended=48.9, cached=475, windows=kill, allowance=8) is (
        invariants.Verdict.COLD_UNSAVED
    )
    assert invariants.classify(before, started=39.5, ended=48.9, cached=336, windows=kill, allowance=8) is (
        invariants.Verdict.LOST  # it lost more than the turns within the allowance
    )
    assert invariants.classify(before, started=39.5, ended=39.9, cached=475, windows=kill, allowance=8) is (
        invariants.Verdict.LOST  # it ended before the kill: the kill did not cost it
    )


def test_an_earlier_turn_of_its_own_after_a_process_fault_is_what_a_ram_cache_leave_allows() -> None:
    """A conversation that left its slot for llama-server's RAM cache unsaved (``--max-unsaved-seconds``) falls
    back to its newest snapshot when the process goes, however long after its turn: counted apart, not lost."""
    before = done((10, 743), (20, 794))
    sigterm = [invariants.Window(schedule.Fault.SIGTERM, 21.7, 21.7)]
    assert invariants.classify(before, started=50, cached=746, windows=sigterm, allowance=8) is (
        invariants.Verdict.COLD_RAM
    )
    kill = [invariants.Window(KILL, 60, 60)]
    assert invariants.classify(before, started=70, cached=746, windows=kill, allowance=8) is invariants.Verdict.COLD_RAM
    assert invariants.classify(before, started=50, cached=336, windows=sigterm, allowance=8) is (
        invariants.Verdict.LOST  # less than any turn of its own: nothing explains it
    )
    assert invariants.classify(before, started=50, cached=746, windows=[], allowance=8) is (
        invariants.Verdict.LOST  # no process went: its newest turn should still be there
    )


def test_a_cold_turn_without_a_fault_is_lost_unless_a_burst_or_a_full_disk_explains_it() -> None:
    before = done((10, 1000))
    assert invariants.classify(before, started=20, cached=0, windows=[], allowance=8) is invariants.Verdict.LOST
    burst = [invariants.Window(schedule.Fault.BURST, 15, 15)]
    assert invariants.classify(before, started=20, cached=0, windows=burst, allowance=8) is (
        invariants.Verdict.COLD_EVICTED
    )
    full = [invariants.Window(schedule.Fault.DISK_FULL, 5, 25), invariants.Window(KILL, 24, 24)]
    assert invariants.classify(before, started=30, cached=0, windows=full, allowance=8) is (
        invariants.Verdict.COLD_STORE_FULL
    )
    while_full = [invariants.Window(schedule.Fault.DISK_FULL, 12, 18)]
    assert invariants.classify(before, started=20, cached=0, windows=while_full, allowance=8) is (
        invariants.Verdict.COLD_STORE_FULL
    )
    # The turn a kill should have found saved ended while the disk was full, long before the kill.
    early = [invariants.Window(schedule.Fault.DISK_FULL, 9, 15), invariants.Window(KILL, 40, 40)]
    two = done((10, 1000), (35, 1100))
    assert invariants.classify(two, started=45, cached=0, windows=early, allowance=8) is (
        invariants.Verdict.COLD_STORE_FULL
    )
    saved_after = [invariants.Window(schedule.Fault.DISK_FULL, 1, 5), invariants.Window(KILL, 40, 40)]
    assert invariants.classify(two, started=45, cached=0, windows=saved_after, allowance=8) is (invariants.Verdict.LOST)
    # The disk filled while the turn was under way (its swap's save came after it was sent).
    under_way = [invariants.Window(schedule.Fault.DISK_FULL, 22, 30)]
    assert invariants.classify(before, started=20, ended=28, cached=0, windows=under_way, allowance=8) is (
        invariants.Verdict.COLD_STORE_FULL
    )
    before_it = [invariants.Window(schedule.Fault.DISK_FULL, 2, 8)]
    assert invariants.classify(before, started=20, cached=0, windows=before_it, allowance=8) is (
        invariants.Verdict.LOST
    )


def test_a_cold_turn_whose_previous_prompt_fit_in_the_sliding_window_is_counted_apart_and_only_then() -> None:
    """llama-server reuses a cache no longer than its window only through its own checkpoints, which no slot
    file holds: nothing the sidecar saves could give it back."""
    assert invariants.classify(done((10, 512)), started=20, cached=21, windows=[], allowance=8, window=512) is (
        invariants.Verdict.COLD_WINDOW
    )
    assert invariants.classify(done((10, 513)), started=20, cached=21, windows=[], allowance=8, window=512) is (
        invariants.Verdict.LOST
    )
    assert invariants.classify(done((10, 512)), started=20, cached=21, windows=[], allowance=8) is (
        invariants.Verdict.LOST  # no window: --swa-full, or a model without one
    )
    assert invariants.classify(done((10, 500)), started=20, cached=500, windows=[], allowance=8, window=512) is (
        invariants.Verdict.WARM
    )
    # A fall back to an earlier turn of its own with no fault is lost, windowed model or not (a conversation of
    # a windowed model is saved before it leaves its slot: its RAM copy would serve only to its checkpoint).
    three = done((10, 1010), (20, 1062))
    assert invariants.classify(three, started=25, cached=1007, windows=[], allowance=8, window=512) is (
        invariants.Verdict.LOST
    )
    # A turn within the window, then one past it killed within the allowance: nothing saved could come back.
    killed = [invariants.Window(KILL, 31, 31)]
    before = done((10, 472), (30, 533))
    assert invariants.classify(before, started=35, cached=0, windows=killed, allowance=8, window=512) is (
        invariants.Verdict.COLD_UNSAVED
    )
    assert invariants.classify(before, started=35, cached=0, windows=killed, allowance=8) is invariants.Verdict.LOST


def test_a_retry_of_a_failed_attempt_may_reuse_all_of_its_own_prompt() -> None:
    """The 60-minute soak: an attempt failed on the sidecar's own outage had reached llama-server and was saved;
    its retry reused 1,206 of its 1,209 tokens, past the 1,137 of the turn before, and was called a wrong KV."""
    before = done((10, 1137))
    assert invariants.reuse_beyond_history(before, 1206)
    assert not invariants.reuse_beyond_history(before, 1206, again=1209)
    assert invariants.reuse_beyond_history(before, 1209 + invariants.REUSE_SLACK + 1, again=1209)


def test_a_reuse_past_the_conversations_history_is_flagged() -> None:
    before = done((10, 500))
    assert not invariants.reuse_beyond_history(before, 500 + invariants.REUSE_SLACK)
    assert invariants.reuse_beyond_history(before, 501 + invariants.REUSE_SLACK)
    assert not invariants.reuse_beyond_history([], 10_000)


def test_the_kv_distance_is_small_for_noise_and_large_for_another_kv() -> None:
    reference = {"The": -0.1, "A": -2.5, "It": -3.0, "x": -9.0}
    noise = {"The": -0.12, "A": -2.45, "It": -3.05, "Some": -4.0}
    assert invariants.kv_distance(noise, reference) < 0.05
    other = {"Hello": -0.01, "Hi": -5.0, "Hey": -6.0}
    assert invariants.kv_distance(other, reference) > 0.8 > invariants.WRONG_KV
    assert invariants.kv_distance({}, {}) == 0.0
    assert invariants.kv_distance({}, reference) == math.inf


def test_a_nat_moved_by_an_unlikely_token_of_the_same_kv_is_noise_not_a_wrong_kv() -> None:
    """As a 15-minute soak measured it (a restored KV against the cold reference, the same conversation): the
    log-probability bound it had (1 nat over tokens above -4) called it wrong."""
    product = {"<": -0.0925, "tool": -4.4507, "Tool": -4.6756, "</": -5.0513, "|": -6.0047}
    reference = {"<": -0.1188, "Tool": -3.6610, "tool": -3.9503, "</": -5.4794, "1": -6.3237}
    assert abs(-4.6756 - -3.6610) > 1.0
    assert invariants.kv_distance(product, reference) < 0.05 < invariants.WRONG_KV


def test_errors_are_allowed_only_when_they_overlap_the_sidecars_outage() -> None:
    outages = [(50.0, 60.0)]
    assert invariants.error_allowed(45, 52, outages)
    assert invariants.error_allowed(55, 70, outages)
    assert not invariants.error_allowed(61, 70, outages)


def test_resources_past_their_bound_are_named() -> None:
    bounds = invariants.Bounds()
    peaks = {"rss_bytes": bounds.rss_bytes + 1.0, "threads": 3.0, "store_bytes": 100.0}
    said = invariants.breaches(peaks, bounds, budget=1000)
    assert len(said) == 1
    assert said[0].startswith("rss_bytes")
    assert invariants.breaches({"store_bytes": 1200.0}, bounds, budget=1000)


def figures(**changed: object) -> report.Figures:
    base = report.Figures(
        seed=3, minutes=2, events=schedule.plan(3, 120), faults_done={"server_kill": 2}, faults_skipped={},
        turns={invariants.Verdict.FIRST: 4, invariants.Verdict.WARM: 9, invariants.Verdict.COLD_UNSAVED: 1},
        errors_allowed=1, errors_cut=[], clients=2, errors=[], kv_checks=3, kv_wrong=[], kv_worst=0.1,
        reuse_beyond=0, peaks={"rss_bytes": 1e8}, breaches=[], orphans=0, sigterm_status=[0], back_seconds=[4.0],
        verify_status=0, verify_summary="{}", store={"missing": 0}, budget=1 << 30, notes=[], rss_growth=1.01,
    )  # fmt: skip
    return dataclasses.replace(base, **changed)  # type: ignore[arg-type]


def test_the_report_says_missed_for_each_broken_invariant_and_prints_the_seed_and_schedule() -> None:
    good = figures()
    assert all(report.verdicts(good).values())
    assert good.warm_share() == 0.9
    text = report.render(good)
    assert "MISSED" not in text
    assert "--seed 3" in text
    assert schedule.plan(3, 120)[0].describe() in text
    for broken in (
        {"orphans": 1},
        {"kv_wrong": ["x"]},
        {"errors": ["x"]},
        {"verify_status": 1},
        {"sigterm_status": [0, 1]},
        {"store": {"missing": 2}},
        {"breaches": ["rss"]},
        {"turns": {invariants.Verdict.WARM: 9, invariants.Verdict.LOST: 1}},
        {"turns": {invariants.Verdict.FIRST: 4, invariants.Verdict.WARM: 1}},
    ):
        bad = figures(**broken)
        assert not all(report.verdicts(bad).values()), broken
        assert "MISSED" in report.render(bad)


def test_a_disk_full_after_the_newest_due_turn_was_saved_explains_its_snapshot_gone_at_the_next_kill() -> None:
    """Soak, seed 7: a turn saved at 226 s; the disk filled at 263.9 s and the sidecar deleted its oldest
    snapshots for space, that one among them; the next turn ran cold (explained); the sidecar was killed 3 s
    after that turn, within the allowance; the turn after found nothing."""
    before = done((203.6, 934), (223.0, 1007), (292.8, 1084))
    full = invariants.Window(schedule.Fault.DISK_FULL, 263.9, 274.0)
    kill = invariants.Window(schedule.Fault.SIDECAR_KILL, 295.5, 295.5)
    assert invariants.classify(before, started=300, ended=312.9, cached=0, windows=[full, kill], allowance=7) is (
        invariants.Verdict.COLD_STORE_FULL
    )
    assert invariants.classify(before, started=300, ended=312.9, cached=0, windows=[kill], allowance=7) is (
        invariants.Verdict.LOST
    )
    earlier = invariants.Window(schedule.Fault.DISK_FULL, 150.0, 160.0)  # before the turn: its save came after
    assert invariants.classify(before, started=300, ended=312.9, cached=0, windows=[earlier, kill], allowance=7) is (
        invariants.Verdict.LOST
    )


def test_a_kill_as_the_previous_turn_ended_counts_and_a_burst_before_it_explains_the_older_snapshot_gone() -> None:
    """Soak, seed 7: a conversation's turn ended as llama-server was killed (its save's rewind was cut); the
    client read the answer's end a moment after the kill. Its next turn found nothing: the turn before had been
    evicted by a burst of new conversations. Both faults explain it; neither alone did to the old rule."""
    before = done((34.4, 850), (152.45, 927))
    kill = invariants.Window(KILL, 152.40, 152.40)
    burst = invariants.Window(schedule.Fault.BURST, 140, 140)
    assert invariants.classify(before, started=165, ended=171.6, cached=0, windows=[kill, burst], allowance=8) is (
        invariants.Verdict.COLD_EVICTED
    )
    assert invariants.classify(before, started=165, ended=171.6, cached=0, windows=[kill], allowance=8) is (
        invariants.Verdict.LOST  # without the burst, the turn the kill should have left was there to restore
    )
    assert invariants.classify(before, started=165, ended=171.6, cached=845, windows=[kill], allowance=8) is (
        invariants.Verdict.COLD_UNSAVED
    )
    long_before = invariants.Window(KILL, 150.0, 150.0)  # 2.45 s before the turn's end: the turn ran after it
    assert invariants.classify(before, started=165, ended=171.6, cached=845, windows=[long_before], allowance=8) is (
        invariants.Verdict.LOST
    )
