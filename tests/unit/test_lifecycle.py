"""One watched server's life (engine.lifecycle): every row of its tables, its guards, properties over any history."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import TypeVar

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.core import events
from sidecar.engine import lifecycle
from sidecar.engine.lifecycle import Kind, Round, Stage

T = TypeVar("T", Stage, Round)
DOCS = Path(__file__).resolve().parents[2] / "docs"

_: None = None
"""The stage stays as it is."""
# Written out by hand, not derived from the module: a changed row of lifecycle.GATE fails here.
# Columns: down, loading, suspected, emptied, answers, ready, round_started, round_ended, round_unanswered.
UN, DN, LD, SX, RS, SV = Stage.UNSEEN, Stage.DOWN, Stage.LOADING, Stage.SUSPECT, Stage.RESTORING, Stage.SERVING
EXPECTED_GATE: dict[Stage, tuple[Stage | None, ...]] = {
    UN: (DN, LD, SX, RS, SV, SV, _, _, _),
    DN: (_, LD, SX, RS, SV, SV, _, _, _),
    LD: (DN, _, SX, RS, SV, SV, _, _, _),
    SX: (DN, LD, _, RS, SV, SV, _, _, _),
    RS: (DN, LD, SX, _, SV, SV, _, _, _),
    SV: (DN, LD, SX, RS, _, _, _, _, _),
}
OWED, RUNNING, DONE = Round.OWED, Round.RUNNING, Round.DONE
EXPECTED_ROUND: dict[Round, tuple[Round | None, ...]] = {
    OWED: (_, _, _, _, _, _, RUNNING, _, _),
    RUNNING: (_, _, _, OWED, _, _, _, DONE, OWED),
    DONE: (_, _, _, OWED, _, _, RUNNING, _, OWED),
}


def _rows(expected: Mapping[T, tuple[T | None, ...]]) -> list[tuple[T, Kind, T]]:
    """(state, observation, next state) for every cell of ``expected`` (None: the same state)."""
    return [
        (state, kind, state if to is None else to)
        for state, row in expected.items()
        for kind, to in zip(Kind, row, strict=True)
    ]


def _example(kind: Kind, at: float = 10.0) -> lifecycle.Observation:
    """One observation of ``kind``, seen at ``at`` where it carries a time."""
    examples: dict[Kind, lifecycle.Observation] = {
        Kind.DOWN: lifecycle.Unhealthy(events.Health.DOWN),
        Kind.LOADING: lifecycle.Unhealthy(events.Health.LOADING),
        Kind.SUSPECTED: lifecycle.Suspected(at, "the proxy could not connect"),
        Kind.EMPTIED: lifecycle.Emptied(),
        Kind.ANSWERS: lifecycle.Up(at, ready=False),
        Kind.READY: lifecycle.Up(at, ready=True),
        Kind.ROUND_STARTED: lifecycle.RoundStarted(),
        Kind.ROUND_ENDED: lifecycle.RoundEnded(answered=True),
        Kind.ROUND_UNANSWERED: lifecycle.RoundEnded(answered=False),
    }
    return examples[kind]


def test_the_tables_have_a_row_for_every_state_and_observation() -> None:
    assert set(lifecycle.GATE) == {(s, k) for s in Stage for k in Kind}
    assert set(lifecycle.ROUND) == {(r, k) for r in Round for k in Kind}
    assert {_example(k).kind for k in Kind} == set(Kind)


@pytest.mark.parametrize(("stage", "kind", "to"), _rows(EXPECTED_GATE))
def test_gate_row(stage: Stage, kind: Kind, to: Stage) -> None:
    assert lifecycle.GATE[stage, kind] is to
    # The same row through step(), with no guard in the way (nothing suspected, the round done).
    life = lifecycle.Life(stage=stage, round=Round.DONE, reason="before")
    assert lifecycle.step(life, _example(kind)).stage is to


@pytest.mark.parametrize(("state", "kind", "to"), _rows(EXPECTED_ROUND))
def test_round_row(state: Round, kind: Kind, to: Round) -> None:
    assert lifecycle.ROUND[state, kind] is to
    life = lifecycle.Life(stage=Stage.DOWN, round=state)  # down: no opening refused for the round's sake
    assert lifecycle.step(life, _example(kind)).round is to


def test_the_start_is_closed_and_owes_a_round() -> None:
    assert lifecycle.START.stage is Stage.UNSEEN
    assert not lifecycle.START.open
    assert lifecycle.START.restore_owed
    assert lifecycle.START.closed_because == lifecycle.NOT_POLLED


@pytest.mark.parametrize(
    ("seen", "reason"),
    [
        (lifecycle.Unhealthy(events.Health.DOWN), "llama-server is down"),
        (lifecycle.Unhealthy(events.Health.UNLOADED), "llama-server is unloaded"),
        (lifecycle.Unhealthy(events.Health.LOADING), "llama-server is loading"),
        (lifecycle.Unhealthy(events.Health.DOWN, "the router is down: refused"), "the router is down: refused"),
        (lifecycle.Suspected(3.0, "connection reset"), "connection reset"),
        (lifecycle.Emptied(), lifecycle.OWED),
    ],
)
def test_a_closing_observation_says_why(seen: lifecycle.Observation, reason: str) -> None:
    after = lifecycle.step(lifecycle.Life(stage=Stage.SERVING, round=Round.DONE), seen)
    assert not after.open
    assert after.closed_because == reason
    assert lifecycle.problem(after.closed_because) == f"restore gate closed: {reason}"


def test_a_suspicion_is_cleared_only_by_a_poll_that_started_after_it() -> None:
    life = lifecycle.step(lifecycle.Life(stage=Stage.SERVING, round=Round.DONE), lifecycle.Suspected(5.0, "refused"))
    for at in (4.9, 5.0):
        for ready in (False, True):
            assert lifecycle.step(life, lifecycle.Up(at, ready=ready)) == life
    opened = lifecycle.step(life, lifecycle.Up(5.1, ready=True))
    assert opened.open
    assert opened.suspect_at is None
    assert opened.reason == "refused"  # kept for the open's log line; not said while open
    assert opened.closed_because == ""


def test_a_suspicion_outlives_other_closings() -> None:
    life = lifecycle.step(lifecycle.Life(stage=Stage.SERVING, round=Round.DONE), lifecycle.Suspected(5.0, "refused"))
    life = lifecycle.step(life, lifecycle.Unhealthy(events.Health.DOWN))
    assert life.stage is Stage.DOWN
    assert lifecycle.step(life, lifecycle.Up(4.0, ready=False)) == life


def test_a_ready_poll_opens_only_once_the_round_is_done_an_answering_one_at_once() -> None:
    owed = lifecycle.step(lifecycle.START, lifecycle.Emptied())
    assert owed.restoring
    assert lifecycle.step(owed, lifecycle.Up(1.0, ready=True)) == owed
    assert lifecycle.step(owed, lifecycle.Up(1.0, ready=False)).open  # asleep: nothing can be restored now
    running = lifecycle.step(owed, lifecycle.RoundStarted())
    assert running.restore_owed
    assert lifecycle.step(running, lifecycle.Up(1.0, ready=True)) == running
    done = lifecycle.step(running, lifecycle.RoundEnded())
    assert not done.restore_owed
    assert lifecycle.step(done, lifecycle.Up(1.0, ready=True)).open


def test_a_round_the_server_lost_its_slots_during_stays_owed() -> None:
    running = lifecycle.step(lifecycle.step(lifecycle.START, lifecycle.Emptied()), lifecycle.RoundStarted())
    again = lifecycle.step(running, lifecycle.Emptied())
    ended = lifecycle.step(again, lifecycle.RoundEnded())
    assert ended.round is Round.OWED
    assert not lifecycle.step(ended, lifecycle.Up(1.0, ready=True)).open


# ---- properties over any history ------------------------------------------------------------

_times = st.floats(min_value=0.0, max_value=1000.0, allow_nan=False)
observations = st.one_of(
    st.builds(lifecycle.Unhealthy, st.sampled_from([h for h in events.Health if h is not events.Health.OK])),
    st.builds(lifecycle.Suspected, _times, st.sampled_from(["refused", "child exited"])),
    st.builds(lifecycle.Emptied),
    st.builds(lifecycle.Up, _times, st.booleans()),
    st.builds(lifecycle.RoundStarted),
    st.builds(lifecycle.RoundEnded, st.booleans()),
)


def _live(history: list[lifecycle.Observation]) -> lifecycle.Life:
    life = lifecycle.START
    for seen in history:
        life = lifecycle.step(life, seen)
    return life


@given(st.lists(observations, max_size=30))
def test_any_history_ends_serving_after_a_poll_after_it_and_a_round(history: list[lifecycle.Observation]) -> None:
    life = _live(history)
    later = 2000.0  # after every suspicion of the history
    for seen in (lifecycle.Up(later, ready=True), lifecycle.RoundStarted(), lifecycle.RoundEnded()):
        life = lifecycle.step(life, seen)
    life = lifecycle.step(life, lifecycle.Up(later, ready=True))
    assert life.open
    assert life.stage is Stage.SERVING
    assert not life.restore_owed
    assert life.suspect_at is None


@given(st.lists(observations, max_size=30), observations)
def test_every_step_keeps_the_invariants(history: list[lifecycle.Observation], seen: lifecycle.Observation) -> None:
    before = _live(history)
    after = lifecycle.step(before, seen)
    assert not (after.open and after.suspect_at is not None)  # open means no suspicion stands
    assert not (after.open and after.restoring)
    if after.suspect_at is None and before.suspect_at is not None:
        assert isinstance(seen, lifecycle.Up)  # only a poll clears a suspicion...
        assert seen.at > before.suspect_at  # ...one that started after it
        assert after.open
    if after.open and not before.open:
        assert isinstance(seen, lifecycle.Up)
        assert not (seen.ready and after.restore_owed)  # a ready poll never opens on a round owed
    if seen.kind in lifecycle.CLOSING:
        assert not after.open


# ---- the doc draws the same tables -----------------------------------------------------------


def drawn() -> str:
    """The tables of docs/architecture.md's lifecycle section, drawn from lifecycle.GATE and lifecycle.ROUND."""
    head = "| | " + " | ".join(f"`{k}`" for k in Kind) + " |\n|---|" + "---|" * len(Kind) + "\n"
    gate = "".join(
        f"| **{s}** | "
        + " | ".join("·" if lifecycle.GATE[s, k] is s else str(lifecycle.GATE[s, k]) for k in Kind)
        + " |\n"
        for s in Stage
    )
    round_ = "".join(
        f"| **{r}** | "
        + " | ".join("·" if lifecycle.ROUND[r, k] is r else str(lifecycle.ROUND[r, k]) for k in Kind)
        + " |\n"
        for r in Round
    )
    return f"Stage (the gate is open only in `serving`):\n\n{head}{gate}\nRestore round:\n\n{head}{round_}"


def test_the_architecture_page_draws_the_tables_as_they_are() -> None:
    text = (DOCS / "architecture.md").read_text(encoding="utf-8")
    found = re.search(r"<!-- lifecycle tables: .*? -->\n\n(.*?)\n<!-- end of lifecycle tables -->", text, re.S)
    assert found is not None, "docs/architecture.md lost its lifecycle tables' markers"
    assert found.group(1) == drawn(), (
        "docs/architecture.md's lifecycle tables differ from the code's; they are:\n\n" + drawn()
    )


def test_the_glossary_names_every_stage() -> None:
    text = (DOCS / "GLOSSARY.md").read_text(encoding="utf-8")
    for stage in Stage:
        assert f"| {stage} (lifecycle) |" in text
