"""plan.plan: what a restore round restores, where and in what order (pure)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from sidecar.core import hashing
from sidecar.restore import plan
from sidecar.snapshots import manifest

FP = manifest.Fingerprint("b1", "/m.gguf", 1, 1, 4096, 2)


def snap(slot: int, generation: int, name: str) -> manifest.Manifest:
    return manifest.Manifest(
        slot=slot,
        file=f"{name}.bin",
        tokens=600,
        bytes=100,
        checksum=manifest.Checksum(hashing.Algorithm.SHA256, "0" * 64),
        generation=generation,
        created=float(generation),
        task=1,
        fingerprint=FP,
    )


# 2 slots, 4 conversations: A then C in slot 0, B then D in slot 1 (C and D the newest of their slots).
A, B, C, D = snap(0, 1, "A"), snap(1, 2, "B"), snap(0, 3, "C"), snap(1, 4, "D")
FOUR = (D, C, B, A)  # newest first, as the store lists them


def shape(steps: tuple[plan.Step, ...]) -> list[tuple[int, list[str], str | None]]:
    return [(s.slot, [c.file[0] for c in s.candidates], s.wanted) for s in steps]


def test_with_nobody_waiting_each_slot_gets_its_own_newest_first_in_slot_order() -> None:
    assert shape(plan.plan((0, 1), (), FOUR)) == [(0, ["C", "A"], None), (1, ["D", "B"], None)]


def test_a_waiting_conversation_that_is_no_slots_newest_is_restored_first_into_the_slot_it_was_saved_from() -> None:
    steps = plan.plan((0, 1), ("B.bin",), FOUR)
    assert shape(steps) == [(1, ["B", "D"], "B.bin"), (0, ["C", "A"], None)]  # D only if B fails its check


def test_the_newest_it_displaced_goes_into_a_slot_with_no_snapshot_of_its_own() -> None:
    steps = plan.plan((0, 1, 2), ("A.bin",), (C, A))
    assert shape(steps) == [(0, ["A"], "A.bin"), (1, ["C"], None), (2, [], None)]
    steps = plan.plan((0, 1), ("A.bin",), (C, A))
    assert shape(steps) == [(0, ["A"], "A.bin"), (1, ["C"], None)]


def test_wants_go_in_the_order_they_came_and_one_whose_slot_is_taken_goes_to_a_slot_no_later_want_needs() -> None:
    # C and A both come from slot 0: C (wanted first) takes it; A goes to slot 1, which D (wanted later) ...
    steps = plan.plan((0, 1, 2), ("C.bin", "A.bin", "D.bin"), FOUR)
    # ... needs: A takes slot 2 instead, D its own slot 1.
    assert shape(steps) == [(0, ["C"], "C.bin"), (2, ["A"], "A.bin"), (1, ["D", "B"], "D.bin")]


def test_more_wants_than_slots_leave_the_last_to_wait_for_the_round() -> None:
    steps = plan.plan((0,), ("A.bin", "C.bin"), FOUR)
    assert shape(steps) == [(0, ["A", "C"], "A.bin")]


def test_a_want_already_restored_or_unknown_is_not_planned_again() -> None:
    steps = plan.plan((1,), ("A.bin", "gone.bin"), FOUR, done=("A.bin",))
    assert shape(steps) == [(1, ["D", "B"], None)]


def test_a_wanted_snapshot_falls_back_to_its_slots_own_snapshots_no_other_step_restores() -> None:
    steps = plan.plan((0, 1), ("A.bin",), FOUR)
    assert shape(steps) == [(0, ["A", "C"], "A.bin"), (1, ["D", "B"], None)]


@given(
    pending=st.lists(st.integers(0, 3), min_size=1, max_size=4, unique=True),
    wanted=st.lists(st.sampled_from(["A.bin", "B.bin", "C.bin", "D.bin", "x.bin"]), max_size=5),
    done=st.sets(st.sampled_from(["A.bin", "B.bin", "C.bin", "D.bin"])),
)
def test_every_pending_slot_is_planned_once_no_file_twice_and_wants_lead(
    pending: list[int], wanted: list[str], done: set[str]
) -> None:
    steps = plan.plan(pending, wanted, FOUR, done=done)
    assert sorted(s.slot for s in steps) == sorted(pending)
    firsts = [s.candidates[0].file for s in steps if s.candidates]
    assert len(firsts) == len(set(firsts))
    assert not set(firsts) & done
    led = [s.wanted for s in steps]
    assert led == sorted(led, key=lambda w: w is None)  # wanted steps first
    for step in steps:
        if step.wanted is not None:
            assert step.candidates[0].file == step.wanted
            assert step.wanted in wanted
