"""policy.Policy (when to save), plan_restore (what to restore) and select_for_deletion (retention)."""

from __future__ import annotations

import dataclasses
import datetime
import random
from pathlib import Path

import pytest

from sidecar.core import config, events, hashing, outcomes
from sidecar.restore import plan
from sidecar.save import policy
from sidecar.snapshots import manifest
from tests.support.views import slot

TIMING = config.SnapshotSettings(slot_dir=Path("slots"), idle_seconds=2.0, interval=10.0, min_tokens=100)
IDENTITY = events.Identity(
    build_info="b1", model_path="/m.gguf", total_slots=4, n_ctx=8192, model_size=1000, model_params=10
)
FP = manifest.Fingerprint.of(IDENTITY, n_ctx=4096)
Idle = policy.SaveReason.IDLE


def snap(
    slot_id: int,
    created: float,
    *,
    tokens: int = 500,
    size: int = 100,
    fingerprint: manifest.Fingerprint = FP,
) -> manifest.Manifest:
    stamp = datetime.datetime.fromtimestamp(created, datetime.UTC).strftime("%Y%m%dT%H%M%S%fZ")
    return manifest.Manifest(
        slot=slot_id,
        file=f"slot{slot_id}-{stamp}.bin",
        tokens=tokens,
        bytes=size,
        checksum=manifest.Checksum(hashing.Algorithm.SHA256, "0" * 64),
        generation=int(created),
        created=created,
        task=1,
        fingerprint=fingerprint,
    )


def saves(actions: list[policy.Save | policy.Skip]) -> list[policy.Save]:
    return [a for a in actions if isinstance(a, policy.Save)]


def run_like_engine(pol: policy.Policy, now: float) -> list[policy.Save | policy.Skip]:
    """What the engine does with due(): a Save that succeeds or a Skip both settle the content."""
    actions = pol.due(now)
    for action in actions:
        pol.settle(action.slot, action.signature)
    return actions


# ---- Policy: idle debounce -----------------------------------------------------------


def test_idle_debounce_one_save_after_idle_seconds() -> None:
    pol = policy.Policy(TIMING)
    pol.observe([slot(0, task=1, tokens=500)], now=0.0)
    assert pol.due(0.0) == []
    assert pol.due(1.99) == []
    assert run_like_engine(pol, 2.0) == [policy.Save(0, events.SlotContent(1, 500), 500, Idle)]
    pol.observe([slot(0, task=1, tokens=500)], now=3.0)
    assert pol.due(3.0) == []
    assert pol.due(1000.0) == []


def test_each_change_restarts_the_idle_timer() -> None:
    pol = policy.Policy(TIMING)
    pol.observe([slot(0, task=1, tokens=500)], now=0.0)
    pol.observe([slot(0, task=2, tokens=800)], now=1.5)  # an agent's tool loop: next request came fast
    assert pol.due(2.0) == []
    pol.observe([slot(0, task=3, tokens=1100)], now=3.0)
    assert pol.due(4.9) == []
    assert pol.due(5.0) == [policy.Save(0, events.SlotContent(3, 1100), 1100, Idle)]


def test_idle_timer_starts_when_the_slot_stops_being_busy() -> None:
    pol = policy.Policy(TIMING)
    pol.observe([slot(0, task=1, tokens=500, busy=True)], now=0.0)
    pol.observe([slot(0, task=1, tokens=900, busy=True)], now=5.0)
    pol.observe([slot(0, task=1, tokens=900)], now=6.0)
    assert pol.due(7.9) == []
    assert pol.due(8.0) == [policy.Save(0, events.SlotContent(1, 900), 900, Idle)]


def test_virgin_slot_is_never_saved() -> None:
    pol = policy.Policy(TIMING)
    pol.observe([slot(0), slot(1)], now=0.0)
    assert pol.due(100.0) == []
    assert pol.final() == []


# ---- Policy: periodic ----------------------------------------------------------------


def test_periodic_save_for_a_slot_that_keeps_changing() -> None:
    pol = policy.Policy(TIMING)
    got: list[tuple[float, policy.Save]] = []
    for step in range(26):  # a new task finishes between every two polls, one second apart
        now = float(step)
        pol.observe([slot(0, task=step, tokens=200 + step)], now=now)
        got += [(now, s) for s in saves(run_like_engine(pol, now))]
    assert got == [
        (10.0, policy.Save(0, events.SlotContent(10, 210), 210, policy.SaveReason.PERIODIC)),
        (21.0, policy.Save(0, events.SlotContent(21, 221), 221, policy.SaveReason.PERIODIC)),
    ]


def test_periodic_not_proposed_for_unchanged_settled_slot() -> None:
    pol = policy.Policy(TIMING)
    pol.observe([slot(0, task=1, tokens=500)], now=0.0)
    pol.settle(0, events.SlotContent(1, 500))
    for step in range(1, 40):
        pol.observe([slot(0, task=1, tokens=500)], now=float(step))
        assert pol.due(float(step)) == []


# ---- Policy: min tokens, settled, busy -----------------------------------------------


def test_skip_below_min_tokens_reported_once_per_content() -> None:
    pol = policy.Policy(TIMING)
    pol.observe([slot(0, task=1, tokens=50)], now=0.0)
    first = run_like_engine(pol, 0.0)
    assert len(first) == 1
    assert isinstance(first[0], policy.Skip)
    assert first[0].signature == (1, 50)
    assert "50" in first[0].why
    assert "--min-tokens 100" in first[0].why
    for step in range(1, 30):
        pol.observe([slot(0, task=1, tokens=50)], now=float(step))
        assert run_like_engine(pol, float(step)) == []
    pol.observe([slot(0, task=2, tokens=60)], now=30.0)
    assert [type(a) for a in run_like_engine(pol, 30.0)] == [policy.Skip]
    pol.observe([slot(0, task=3, tokens=600)], now=31.0)
    assert run_like_engine(pol, 33.0) == [policy.Save(0, events.SlotContent(3, 600), 600, Idle)]


def test_slot_cleared_to_zero_tokens_is_skipped_not_saved() -> None:
    pol = policy.Policy(TIMING)
    pol.observe([slot(0, task=1, tokens=500)], now=0.0)
    assert saves(run_like_engine(pol, 2.0)) == [policy.Save(0, events.SlotContent(1, 500), 500, Idle)]
    pol.observe([slot(0, task=1, tokens=0)], now=3.0)
    assert [type(a) for a in run_like_engine(pol, 10.0)] == [policy.Skip]


def test_settled_content_is_not_saved_again() -> None:
    pol = policy.Policy(TIMING)
    pol.settle(0, events.SlotContent(1, 500))  # adopted at start-up: the newest snapshot holds this content
    pol.observe([slot(0, task=1, tokens=500)], now=0.0)
    assert pol.due(50.0) == []
    pol.observe([slot(0, task=1, tokens=500, busy=True)], now=51.0)
    pol.observe([slot(0, task=1, tokens=500)], now=52.0)
    assert pol.due(60.0) == []


def test_a_listing_read_before_the_one_followed_is_ignored() -> None:
    pol = policy.Policy(TIMING)
    pol.observe([slot(0, task=1, tokens=500)], now=1.0)  # the poll's listing, read at 1.0
    pol.observe([slot(0, task=2, tokens=520)], now=3.5, read_at=3.0)  # a save read the slot afresh
    pol.settle(0, events.SlotContent(2, 520))
    pol.observe([slot(0, task=1, tokens=500)], now=4.0, read_at=1.0)  # the poll carries its listing over
    assert pol.due(10.0) == []
    pol.observe([slot(0, task=3, tokens=540)], now=11.0, read_at=11.0)  # a newer listing counts again
    assert [a.signature for a in saves(pol.due(13.0))] == [(3, 540)]


def test_never_a_save_for_a_busy_slot() -> None:
    pol = policy.Policy(TIMING)
    for step in range(60):
        pol.observe([slot(0, task=1, tokens=100 + 50 * step, busy=True)], now=float(step))
        assert pol.due(float(step)) == []
    pol.observe([slot(0, task=1, tokens=5000)], now=60.0)
    # Dirty for longer than --snapshot-interval: saved as soon as it is idle, no debounce.
    assert pol.due(60.0) == [policy.Save(0, events.SlotContent(1, 5000), 5000, policy.SaveReason.PERIODIC)]


def test_busy_slot_within_interval_waits_for_idle_seconds() -> None:
    pol = policy.Policy(TIMING)
    for step in range(5):
        pol.observe([slot(0, task=1, tokens=100 + 50 * step, busy=True)], now=float(step))
        assert pol.due(float(step) + 0.5) == []
    pol.observe([slot(0, task=1, tokens=900)], now=5.0)
    assert pol.due(6.99) == []
    assert pol.due(7.0) == [policy.Save(0, events.SlotContent(1, 900), 900, Idle)]


def test_defer_after_a_failed_save() -> None:
    pol = policy.Policy(TIMING)
    pol.observe([slot(0, task=1, tokens=500)], now=0.0)
    assert pol.due(2.0) == [policy.Save(0, events.SlotContent(1, 500), 500, Idle)]
    pol.defer(0, until=32.0)
    assert pol.due(2.0) == []
    assert pol.due(31.99) == []
    assert pol.due(32.0) == [policy.Save(0, events.SlotContent(1, 500), 500, Idle)]


def test_defer_is_per_slot() -> None:
    pol = policy.Policy(TIMING)
    pol.observe([slot(0, task=1, tokens=500), slot(1, task=2, tokens=700)], now=0.0)
    pol.defer(0, until=100.0)
    assert pol.due(5.0) == [policy.Save(1, events.SlotContent(2, 700), 700, Idle)]


def test_reset_forgets_settled_content() -> None:
    pol = policy.Policy(TIMING)
    pol.observe([slot(0, task=1, tokens=500)], now=0.0)
    pol.settle(0, events.SlotContent(1, 500))
    pol.reset()
    assert pol.tracks == {}
    pol.observe([slot(0, task=1, tokens=500)], now=10.0)
    assert pol.due(12.0) == [policy.Save(0, events.SlotContent(1, 500), 500, Idle)]


def test_a_due_save_may_be_held_until_its_oldest_change_is_interval_old() -> None:
    pol = policy.Policy(TIMING)
    pol.observe([slot(0, task=1, tokens=500, busy=True)], 0.0)
    pol.observe([slot(0, task=1, tokens=600)], 4.0)
    assert pol.may_hold(0, 9.9)
    assert not pol.may_hold(0, 10.0)  # TIMING.interval after the change began
    assert not pol.may_hold(3, 0.0)  # a slot never seen


def test_save_hold_seconds_ends_the_hold_before_the_interval_and_zero_never_holds() -> None:
    for hold, held in ((4.0, [True, False, False]), (0.0, [False, False, False]), (30.0, [True, True, False])):
        pol = policy.Policy(dataclasses.replace(TIMING, hold_seconds=hold))
        pol.observe([slot(0, task=1, tokens=600)], 1.0)
        assert [pol.may_hold(0, now) for now in (4.9, 5.0, 11.0)] == held, hold


def test_the_unsaved_tail_is_what_a_slot_holds_past_its_last_snapshot_while_it_continues_it() -> None:
    pol = policy.Policy(TIMING)
    pol.observe([slot(0, task=1, tokens=600)], 1.0)
    assert pol.unsaved_tokens(0) == 600  # nothing saved yet: all of it
    pol.settle(0, events.SlotContent(1, 600))
    assert pol.unsaved_tokens(0) == 0
    pol.observe([slot(0, task=2, tokens=650)], 2.0)
    assert pol.unsaved_tokens(0) == 50
    pol.observe([slot(0, task=3, tokens=40)], 3.0)  # fewer tokens than the snapshot: another content
    pol.observe([slot(0, task=4, tokens=700)], 4.0)
    assert pol.unsaved_tokens(0) == 700
    pol.settle(0, events.SlotContent(4, 700), kept=False)  # judged not worth a file: no snapshot holds it
    pol.observe([slot(0, task=5, tokens=720)], 5.0)
    assert pol.unsaved_tokens(0) == 720
    pol.settle(0, events.SlotContent(5, 720))
    pol.observe([slot(0, task=6, tokens=730)], 6.0)
    pol.unsettle(0, events.SlotContent(5, 720), 6.0)  # its commit failed: the snapshot before is not known
    assert pol.unsaved_tokens(0) == 730
    assert pol.unsaved_tokens(3) == 0  # a slot never seen


def test_a_save_past_its_hold_is_weighed_with_its_tail_and_never_with_no_hold() -> None:
    pol = policy.Policy(dataclasses.replace(TIMING, hold_seconds=4.0, max_unsaved_seconds=10.0))
    pol.observe([slot(0, task=1, tokens=3000)], 1.0)
    pol.settle(0, events.SlotContent(1, 3000))
    pol.observe([slot(0, task=2, tokens=3004)], 2.0)
    weighing = pol.weigh(0, rate=400.0, pace=0.4 / 1000)
    assert weighing is not None
    assert not weighing.save
    assert weighing.reprefill == pytest.approx(0.01)
    assert weighing.stall == pytest.approx(1.2016)
    pol.observe([slot(0, task=3, tokens=4000)], 3.0)
    weighing = pol.weigh(0, rate=400.0, pace=0.4 / 1000)
    assert weighing is not None
    assert weighing.save
    assert pol.weigh(5, rate=400.0, pace=0.4 / 1000) is None  # a slot never seen
    never = policy.Policy(dataclasses.replace(TIMING, hold_seconds=0.0))
    never.observe([slot(0, task=2, tokens=3004)], 2.0)
    assert never.weigh(0, rate=400.0, pace=0.4 / 1000) is None  # --save-hold-seconds 0: saved at once


def test_final_idle_first_then_busy_and_only_changed_slots_worth_a_file() -> None:
    pol = policy.Policy(TIMING)
    pol.observe(
        [
            slot(0, task=1, tokens=900, busy=True),  # changed, busy: last
            slot(1, task=2, tokens=800),  # changed, idle
            slot(2, task=3, tokens=700),  # settled
            slot(3, task=4, tokens=20),  # too small
            slot(4, task=5, tokens=600),  # changed, idle
            slot(5),  # virgin
        ],
        now=0.0,
    )
    pol.settle(2, events.SlotContent(3, 700))
    got = pol.final()
    assert [(s.slot, s.signature, s.reason) for s in got] == [
        (1, (2, 800), policy.SaveReason.FINAL),
        (4, (5, 600), policy.SaveReason.FINAL),
        (0, (1, 900), policy.SaveReason.FINAL),
    ]
    assert [s.tokens for s in got] == [800, 600, 900]


# ---- plan_restore --------------------------------------------------------------------


@pytest.mark.parametrize(
    "view",
    [
        slot(0, busy=True),
        slot(0, task=7, tokens=0, busy=True),
        slot(0, task=7, tokens=300),
    ],
    ids=["busy virgin", "busy cleared", "idle holding tokens"],
)
def test_restore_never_into_a_busy_or_non_empty_slot(view: events.SlotView) -> None:
    chosen = plan.plan_restore(view, [snap(0, 100.0)], IDENTITY)
    assert chosen == plan.RestorePlan(0, (), outcomes.RestoreOutcome.SLOT_BUSY)


def test_busy_wins_over_no_snapshot() -> None:
    chosen = plan.plan_restore(slot(0, busy=True), [], IDENTITY)
    assert chosen.outcome is outcomes.RestoreOutcome.SLOT_BUSY


def test_no_snapshot() -> None:
    assert plan.plan_restore(slot(0), [], IDENTITY) == plan.RestorePlan(0, (), outcomes.RestoreOutcome.NO_SNAPSHOT)


def test_slot_cleared_by_cache_idle_slots_may_be_restored() -> None:
    s = snap(0, 100.0)
    chosen = plan.plan_restore(slot(0, task=7, tokens=0), [s], IDENTITY)
    assert chosen == plan.RestorePlan(0, (s,), None)


def test_all_incompatible_names_each_field() -> None:
    other_build = snap(
        0, 300.0, fingerprint=manifest.Fingerprint.of(events.Identity("b0", "/m.gguf", 4, 8192, 1000, 10), n_ctx=4096)
    )
    other_model = snap(
        0,
        200.0,
        fingerprint=manifest.Fingerprint.of(events.Identity("b1", "/other.gguf", 4, 8192, 1000, 10), n_ctx=4096),
    )
    too_long = snap(0, 100.0, tokens=5000)
    chosen = plan.plan_restore(slot(0, n_ctx=4096), [other_build, other_model, too_long], IDENTITY)
    assert chosen.outcome is outcomes.RestoreOutcome.INCOMPATIBLE
    assert chosen.candidates == ()
    assert [file for file, _ in chosen.refusals] == [other_build.file, other_model.file, too_long.file]
    whys = [why for _, why in chosen.refusals]
    assert whys[0].startswith("build_info:")
    assert "'b0'" in whys[0]
    assert "'b1'" in whys[0]
    assert whys[1].startswith("model_path:")
    assert whys[2].startswith("n_ctx:")


def test_slot_beyond_server_slots_is_incompatible() -> None:
    chosen = plan.plan_restore(slot(5), [snap(5, 1.0)], IDENTITY)
    assert chosen.outcome is outcomes.RestoreOutcome.INCOMPATIBLE
    assert chosen.refusals[0][1].startswith("total_slots:")


def test_newest_compatible_first() -> None:
    old_fp = manifest.Fingerprint.of(events.Identity("b0", "/m.gguf", 4, 8192, 1000, 10), n_ctx=4096)
    newest_bad = snap(0, 400.0, fingerprint=old_fp)
    newer, older, oldest = snap(0, 300.0), snap(0, 200.0), snap(0, 100.0)
    chosen = plan.plan_restore(slot(0), [newest_bad, newer, older, oldest], IDENTITY)
    assert chosen.outcome is None
    assert chosen.candidates == (newer, older, oldest)
    assert [file for file, _ in chosen.refusals] == [newest_bad.file]


@pytest.mark.parametrize("seed", range(5))
def test_newest_compatible_first_whatever_the_input_order(seed: int) -> None:
    snaps = [snap(0, 100.0), snap(0, 300.0), snap(0, 200.0), snap(0, 400.0, tokens=10**6)]
    random.Random(seed).shuffle(snaps)
    chosen = plan.plan_restore(slot(0), snaps, IDENTITY)
    assert [m.created for m in chosen.candidates] == [300.0, 200.0, 100.0]
    assert [file for file, _ in chosen.refusals] == [snap(0, 400.0).file]


# ---- select_for_deletion -------------------------------------------------------------


def doomed(
    snaps: list[manifest.Manifest],
    *,
    keep: int = 100,
    max_bytes: int = 0,
    max_age: float = 0.0,
    now: float = 1000.0,
) -> dict[str, outcomes.GcReason]:
    got = policy.select_for_deletion(snaps, keep_per_slot=keep, max_bytes=max_bytes, max_age=max_age, now=now)
    return {m.file: reason for m, reason in got}


def test_keep_newest_n_per_slot() -> None:
    s0 = [snap(0, t) for t in (10.0, 20.0, 30.0, 40.0)]
    s1 = [snap(1, 15.0)]
    assert doomed(s0 + s1, keep=2) == {s0[0].file: outcomes.GcReason.KEEP, s0[1].file: outcomes.GcReason.KEEP}


def test_keep_zero_still_keeps_the_newest() -> None:
    s0 = [snap(0, t) for t in (10.0, 20.0)]
    assert doomed(s0, keep=0) == {s0[0].file: outcomes.GcReason.KEEP}


def test_byte_cap_deletes_oldest_first_until_under_the_cap() -> None:
    s0 = [snap(0, t, size=100) for t in (10.0, 30.0, 50.0)]
    s1 = [snap(1, t, size=100) for t in (20.0, 40.0)]
    # 500 bytes, cap 250: delete 10 (400), 20 (300), 30 (200), then stop.
    assert doomed(s0 + s1, max_bytes=250) == {
        s0[0].file: outcomes.GcReason.BYTES,
        s1[0].file: outcomes.GcReason.BYTES,
        s0[1].file: outcomes.GcReason.BYTES,
    }


def test_byte_cap_never_takes_a_slots_newest() -> None:
    s0 = [snap(0, t, size=1000) for t in (10.0, 30.0)]
    s1 = [snap(1, 20.0, size=1000)]
    assert doomed(s0 + s1, max_bytes=1) == {s0[0].file: outcomes.GcReason.BYTES}


def test_max_age() -> None:
    s0 = [snap(0, t) for t in (100.0, 500.0, 900.0)]
    s1 = [snap(1, 50.0)]  # the only (so newest) snapshot of slot 1: kept however old
    assert doomed(s0 + s1, max_age=300.0, now=1000.0) == {
        s0[0].file: outcomes.GcReason.AGE,
        s0[1].file: outcomes.GcReason.AGE,
    }


def test_zero_limits_mean_no_limit() -> None:
    s0 = [snap(0, t, size=10**9) for t in (1.0, 2.0)]
    assert doomed(s0, keep=5, max_bytes=0, max_age=0.0, now=1e12) == {}


@pytest.mark.parametrize("seed", range(20))
def test_newest_of_each_slot_never_selected_whatever_the_rules(seed: int) -> None:
    rnd = random.Random(seed)
    snaps = [snap(rnd.randrange(4), float(i), size=rnd.randrange(1, 10_000)) for i in range(rnd.randrange(1, 30))]
    rnd.shuffle(snaps)
    got = doomed(
        snaps,
        keep=rnd.randrange(0, 3),
        max_bytes=rnd.choice([0, 1, 5000]),
        max_age=rnd.choice([0.0, 0.5, 10.0]),
        now=100.0,
    )
    newest = {max((m for m in snaps if m.slot == s), key=lambda m: m.created).file for s in {m.slot for m in snaps}}
    assert newest.isdisjoint(got)
