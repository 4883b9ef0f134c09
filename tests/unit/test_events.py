"""events.detect and events.restart_reasons, fed hand-made observations."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from sidecar.core import events
from tests.support.views import slot

T = events.Transition
IDENTITY = events.Identity(
    build_info="b515-515e85511",
    model_path="/models/gemma3-270m.gguf",
    total_slots=2,
    n_ctx=8192,
    model_size=253_000_000,
    model_params=268_000_000,
)
COUNTERS = events.Counters(start_time=1_700_000_000.0, prompt_tokens=5000.0, cached_tokens=1200.0)


def up(
    at: float,
    *slots: events.SlotView,
    identity: events.Identity | None = IDENTITY,
    counters: events.Counters | None = None,
    fresh: bool = True,
) -> events.Observation:
    """The server up with its slots read; ``counters`` read in this poll unless ``fresh`` is False."""
    return events.Observation(
        at=at,
        health=events.Health.OK,
        slots=slots,
        identity=identity,
        counters=counters,
        counters_fresh=counters is not None and fresh,
    )


def down(at: float, health: events.Health = events.Health.DOWN) -> events.Observation:
    return events.Observation(at=at, health=health, problem="unreachable")


def kinds(evts: list[events.Event]) -> list[events.Transition]:
    return [e.transition for e in evts]


# ---- up and down ---------------------------------------------------------------------


def test_first_observation_up_is_came_up() -> None:
    evts = events.detect(None, up(1.0, slot(0), slot(1)), last_up=None)
    assert evts == [events.Event(T.CAME_UP, 1.0)]


def test_first_observation_down_says_nothing() -> None:
    assert events.detect(None, down(1.0), last_up=None) == []


@pytest.mark.parametrize("health", [events.Health.DOWN, events.Health.LOADING])
def test_went_down_once_then_silent(health: events.Health) -> None:
    before = up(1.0, slot(0, task=3, tokens=500))
    first = down(2.0, health)
    assert events.detect(before, first, last_up=before) == [events.Event(T.WENT_DOWN, 2.0)]
    assert events.detect(first, down(3.0, health), last_up=before) == []


def test_came_up_after_loading_same_process() -> None:
    before = up(1.0, slot(0, task=3, tokens=500), slot(1, task=4, tokens=900))
    loading = down(2.0, events.Health.LOADING)
    evts = events.detect(loading, up(3.0, *before.slots or ()), last_up=before)
    assert kinds(evts) == [T.CAME_UP]


def test_up_with_unreadable_slots_is_only_came_up() -> None:
    before = up(1.0, slot(0, task=3, tokens=500))
    cur = events.Observation(at=3.0, health=events.Health.OK, slots=None, problem="/slots: 501")
    assert kinds(events.detect(down(2.0), cur, last_up=before)) == [T.CAME_UP]


# ---- restarts ------------------------------------------------------------------------


def test_restart_by_process_start_time() -> None:
    before = up(1.0, slot(0, task=3, tokens=500), counters=COUNTERS)
    later = dataclasses.replace(COUNTERS, start_time=1_700_000_060.0, prompt_tokens=9e9)
    after = up(2.0, slot(0, task=3, tokens=500), counters=later)
    assert events.restart_reasons(before, after, was_down=False) == ("process start time changed",)
    evts = events.detect(before, after, last_up=before)
    assert evts == [events.Event(T.RESTARTED, 2.0, reasons=("process start time changed",))]


def test_carried_over_counters_are_not_evidence() -> None:
    # The poller reads /metrics sparingly; counters not read in this poll prove nothing.
    before = up(1.0, slot(0, task=3, tokens=500), counters=COUNTERS)
    other = events.Counters(start_time=1_700_000_060.0, prompt_tokens=0.0, cached_tokens=0.0)
    after = up(2.0, slot(0, task=3, tokens=500), counters=other, fresh=False)
    assert events.restart_reasons(before, after, was_down=False) == ()
    assert kinds(events.detect(before, after, last_up=before)) == []


@pytest.mark.parametrize("was_down", [False, True])
def test_unchanged_start_time_proves_the_same_process(was_down: bool) -> None:
    # A pause (--sleep-idle-seconds, SIGSTOP) or a network blip: slots may come back empty,
    # yet /metrics says the process never changed.
    before = up(1.0, slot(0, task=3, tokens=500), slot(1, task=4, tokens=90), counters=COUNTERS)
    after = up(3.0, slot(0), slot(1), counters=COUNTERS)
    assert events.restart_reasons(before, after, was_down=was_down) == ()
    prev = down(2.0) if was_down else before
    assert T.RESTARTED not in kinds(events.detect(prev, after, last_up=before))


NO_START = dataclasses.replace(COUNTERS, start_time=None)


@pytest.mark.parametrize("field", ["prompt_tokens", "cached_tokens"])
@pytest.mark.parametrize("side", ["before", "after", "both"])
def test_restart_by_counters_going_backwards(field: str, side: str) -> None:
    """Without a start time on both sides, counters going backwards are the evidence."""
    before_counters = NO_START if side in ("before", "both") else COUNTERS
    changes: dict[str, Any] = {field: 10.0}
    after_counters = dataclasses.replace(COUNTERS if side == "before" else NO_START, **changes)
    before = up(1.0, slot(0, task=3, tokens=500), counters=before_counters)
    after = up(2.0, slot(0, task=3, tokens=500), counters=after_counters)
    assert events.restart_reasons(before, after, was_down=False) == ("metrics counters went backwards",)
    assert kinds(events.detect(before, after, last_up=before)) == [T.RESTARTED]


def test_counters_growing_is_not_a_restart() -> None:
    before = up(1.0, slot(0, task=3, tokens=500), counters=NO_START)
    grown = dataclasses.replace(NO_START, prompt_tokens=9000.0, cached_tokens=5000.0)
    after = up(2.0, slot(0, task=3, tokens=500), counters=grown)
    assert events.restart_reasons(before, after, was_down=False) == ()


def test_counters_missing_on_one_side_is_not_a_restart() -> None:
    before = up(1.0, slot(0, task=3, tokens=500), counters=COUNTERS)
    after = up(2.0, slot(0, task=3, tokens=500), counters=None)
    assert events.restart_reasons(before, after, was_down=False) == ()
    assert events.restart_reasons(after, before, was_down=False) == ()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("build_info", "b999-deadbeef"),
        ("model_path", "/models/other.gguf"),
        ("total_slots", 4),
        ("n_ctx", 16384),
        ("model_size", 1),
        ("model_params", 2),
    ],
)
def test_restart_by_identity_change_names_the_field(field: str, value: object) -> None:
    changes: dict[str, Any] = {field: value}
    before = up(1.0, slot(0, task=3, tokens=500))
    after = up(2.0, slot(0, task=3, tokens=500), identity=dataclasses.replace(IDENTITY, **changes))
    assert events.restart_reasons(before, after, was_down=False) == (f"server identity changed: {field}",)
    evts = events.detect(before, after, last_up=before)
    assert kinds(evts) == [T.RESTARTED]
    assert evts[0].reasons == (f"server identity changed: {field}",)


def test_identity_change_names_every_field() -> None:
    before = up(1.0, slot(0, task=3, tokens=500))
    other = dataclasses.replace(IDENTITY, build_info="x", n_ctx=1)
    after = up(2.0, slot(0, task=3, tokens=500), identity=other)
    assert events.restart_reasons(before, after, was_down=False) == ("server identity changed: build_info, n_ctx",)


@pytest.mark.parametrize("side", ["before", "after"])
def test_identity_field_unknown_on_one_side_is_not_a_restart(side: str) -> None:
    # A failed /v1/models read leaves model_size/model_params None: unknown, not different.
    unknown = dataclasses.replace(IDENTITY, model_size=None, model_params=None)
    before = up(1.0, slot(0, task=3, tokens=500), identity=unknown if side == "before" else IDENTITY)
    after = up(2.0, slot(0, task=3, tokens=500), identity=unknown if side == "after" else IDENTITY)
    assert events.restart_reasons(before, after, was_down=False) == ()


def test_identity_change_names_only_fields_known_on_both_sides() -> None:
    before = up(1.0, slot(0, task=3, tokens=500), identity=dataclasses.replace(IDENTITY, model_size=None))
    after = up(2.0, slot(0, task=3, tokens=500), identity=dataclasses.replace(IDENTITY, model_size=5, n_ctx=1))
    assert events.restart_reasons(before, after, was_down=False) == ("server identity changed: n_ctx",)


@pytest.mark.parametrize("new_task", [None, 2], ids=["id_task gone", "id_task smaller"])
def test_restart_by_slot_losing_its_task_history(new_task: int | None) -> None:
    before = up(1.0, slot(0), slot(1, task=7, tokens=500))
    after = up(2.0, slot(0), slot(1, task=new_task, tokens=0 if new_task is None else 40))
    assert events.restart_reasons(before, after, was_down=False) == ("slot 1 lost its task history",)
    assert kinds(events.detect(before, after, last_up=before)) == [T.RESTARTED]


def test_growing_task_ids_are_not_a_restart() -> None:
    before = up(1.0, slot(0, task=3, tokens=500), slot(1))
    after = up(2.0, slot(0, task=9, tokens=50), slot(1, task=10, tokens=7))
    assert events.restart_reasons(before, after, was_down=False) == ()


def test_restart_by_unreachable_and_back_with_every_slot_empty() -> None:
    before = up(1.0, slot(0), slot(1))
    after = up(3.0, slot(0), slot(1))
    reason = "server was unreachable and came back with every slot empty"
    assert events.restart_reasons(before, after, was_down=True) == (reason,)
    assert events.restart_reasons(before, after, was_down=False) == ()
    evts = events.detect(down(2.0), after, last_up=before)
    assert evts == [events.Event(T.CAME_UP, 3.0), events.Event(T.RESTARTED, 3.0, reasons=(reason,))]


def test_unreachable_and_back_with_slots_kept_is_not_a_restart() -> None:
    before = up(1.0, slot(0, task=3, tokens=500), slot(1))
    assert kinds(events.detect(down(2.0), up(3.0, *before.slots or ()), last_up=before)) == [T.CAME_UP]


def test_down_period_carried_across_a_poll_with_unreadable_slots() -> None:
    # The poller passes was_down: the server was down at some poll since last_up.
    before = up(1.0, slot(0), slot(1))
    blind = events.Observation(at=3.0, health=events.Health.OK, slots=None, problem="/slots timed out")
    assert kinds(events.detect(down(2.0), blind, last_up=before, was_down=True)) == [T.CAME_UP]
    assert kinds(events.detect(blind, up(4.0, slot(0), slot(1)), last_up=before, was_down=True)) == [T.RESTARTED]
    # Without it, was_down is read off prev, which was up.
    assert kinds(events.detect(blind, up(4.0, slot(0), slot(1)), last_up=before)) == []


def test_was_down_false_overrides_prev() -> None:
    before = up(1.0, slot(0), slot(1))
    assert kinds(events.detect(down(2.0), up(3.0, slot(0), slot(1)), last_up=before, was_down=False)) == [T.CAME_UP]


@pytest.mark.parametrize("was_down", [False, True])
def test_tokens_dropping_to_zero_with_same_task_is_not_a_restart(was_down: bool) -> None:
    # --cache-idle-slots moved the slot's tokens to the RAM cache: the slot keeps its id_task.
    before = up(1.0, slot(0, task=3, tokens=500), slot(1, task=4, tokens=900))
    after = up(3.0, slot(0, task=3, tokens=0), slot(1, task=4, tokens=0))
    assert events.restart_reasons(before, after, was_down=was_down) == ()
    prev = down(2.0) if was_down else before
    assert T.RESTARTED not in kinds(events.detect(prev, after, last_up=before))


def test_restart_suppresses_busy_and_idle_events() -> None:
    before = up(1.0, slot(0, task=3, tokens=500))
    after = up(2.0, slot(0, busy=True))
    assert kinds(events.detect(before, after, last_up=before)) == [T.RESTARTED]


# ---- busy and idle -------------------------------------------------------------------


def test_became_busy() -> None:
    before = up(1.0, slot(0, task=3, tokens=500), slot(1))
    after = up(2.0, slot(0, task=3, tokens=500), slot(1, task=4, tokens=10, busy=True))
    assert events.detect(before, after, last_up=before) == [events.Event(T.BECAME_BUSY, 2.0, slot=1)]


def test_busy_on_first_sight_is_became_busy() -> None:
    evts = events.detect(None, up(1.0, slot(0, task=1, tokens=5, busy=True)), last_up=None)
    assert evts == [events.Event(T.CAME_UP, 1.0), events.Event(T.BECAME_BUSY, 1.0, slot=0)]


def test_still_busy_says_nothing() -> None:
    before = up(1.0, slot(0, task=4, tokens=10, busy=True))
    after = up(2.0, slot(0, task=4, tokens=300, busy=True))
    assert events.detect(before, after, last_up=before) == []


def test_became_idle_with_new_content() -> None:
    before = up(1.0, slot(0, task=4, tokens=10, busy=True))
    after = up(2.0, slot(0, task=4, tokens=900))
    assert events.detect(before, after, last_up=before) == [events.Event(T.BECAME_IDLE, 2.0, slot=0, changed=True)]


def test_became_idle_with_same_signature_is_unchanged() -> None:
    before = up(1.0, slot(0, task=4, tokens=900, busy=True))
    after = up(2.0, slot(0, task=4, tokens=900))
    assert events.detect(before, after, last_up=before) == [events.Event(T.BECAME_IDLE, 2.0, slot=0, changed=False)]


def test_idle_and_unchanged_says_nothing() -> None:
    before = up(1.0, slot(0, task=4, tokens=900), slot(1))
    after = up(2.0, slot(0, task=4, tokens=900), slot(1))
    assert events.detect(before, after, last_up=before) == []


def test_task_started_and_finished_between_polls() -> None:
    before = up(1.0, slot(0, task=4, tokens=900))
    after = up(2.0, slot(0, task=5, tokens=1400))
    assert events.detect(before, after, last_up=before) == [events.Event(T.BECAME_IDLE, 2.0, slot=0, changed=True)]


def test_first_task_on_a_virgin_slot_between_polls() -> None:
    before = up(1.0, slot(0))
    after = up(2.0, slot(0, task=0, tokens=700))
    assert events.detect(before, after, last_up=before) == [events.Event(T.BECAME_IDLE, 2.0, slot=0, changed=True)]


def test_busy_idle_compared_with_last_up_across_unreadable_poll() -> None:
    before = up(1.0, slot(0, task=4, tokens=900))
    blind = events.Observation(at=2.0, health=events.Health.OK, slots=None, problem="/slots timed out")
    after = up(3.0, slot(0, task=6, tokens=1200))
    assert events.detect(blind, after, last_up=before) == [events.Event(T.BECAME_IDLE, 3.0, slot=0, changed=True)]


def test_slot_view_properties() -> None:
    virgin = slot(0)
    cleared = slot(0, task=3, tokens=0)
    full = slot(0, task=3, tokens=10)
    assert (virgin.signature, virgin.virgin, virgin.empty) == (None, True, True)
    assert (cleared.signature, cleared.virgin, cleared.empty) == ((3, 0), False, True)
    assert (full.signature, full.virgin, full.empty) == ((3, 10), False, False)
    assert up(1.0, virgin, slot(1, task=2, tokens=1)).slot(1) == slot(1, task=2, tokens=1)
    assert up(1.0, virgin).slot(5) is None


# ---- sleep (--sleep-idle-seconds) ----------------------------------------------------


def asleep(at: float) -> events.Observation:
    """A sleeping server: /props says is_sleeping, /slots is not read (it would wake it)."""
    return events.Observation(at=at, health=events.Health.OK, identity=IDENTITY, sleeping=True)


def test_fell_asleep_once() -> None:
    before = up(1.0, slot(0, task=3, tokens=500))
    assert events.detect(before, asleep(2.0), last_up=before) == [events.Event(T.SLEPT, 2.0)]
    assert events.detect(asleep(2.0), asleep(3.0), last_up=None) == []


def test_asleep_at_first_sight() -> None:
    assert kinds(events.detect(None, asleep(1.0), last_up=None)) == [T.CAME_UP, T.SLEPT]


def test_woke_with_empty_slots_is_not_a_restart() -> None:
    before = up(1.0, slot(0, task=3, tokens=500), slot(1, task=4, tokens=600))
    after = up(5.0, slot(0), slot(1))
    assert events.detect(asleep(4.0), after, last_up=before, was_down=False) == [events.Event(T.WOKE, 5.0)]


def test_down_while_asleep_then_back() -> None:
    assert kinds(events.detect(asleep(1.0), down(2.0), last_up=None)) == [T.WENT_DOWN]
