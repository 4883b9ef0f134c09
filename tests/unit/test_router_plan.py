"""Router mode's pure decisions: which models get an engine (plan), which model a request names (admission)."""

from __future__ import annotations

from sidecar.core import events
from sidecar.router import admission, plan

S = events.ModelStatus


def test_every_listed_model_gets_an_engine_whatever_its_state() -> None:
    listed = {"beta": S.UNLOADED, "alpha": S.LOADED, "gamma": S.SLEEPING}
    assert plan.decide(listed, (), limit=8) == plan.Plan(start=("alpha", "beta", "gamma"), stop=())


def test_engines_of_listed_models_are_kept_and_of_unlisted_ones_stopped() -> None:
    listed = {"alpha": S.UNLOADED, "gamma": S.LOADING}
    decided = plan.decide(listed, ("alpha", "beta"), limit=8)
    assert decided == plan.Plan(start=("gamma",), stop=("beta",))


def test_nothing_changes_while_the_list_stays_the_same() -> None:
    listed = {"alpha": S.LOADED, "beta": S.UNLOADED}
    assert plan.decide(listed, ("alpha", "beta"), limit=8) == plan.Plan(start=(), stop=())


def test_the_limit_keeps_running_models_first_then_by_name_and_says_who_is_left_out() -> None:
    listed = {"d": S.UNLOADED, "c": S.LOADED, "b": S.UNLOADED, "a": S.UNLOADED}
    decided = plan.decide(listed, (), limit=2)
    assert decided.start == ("a", "c")
    assert decided.left_out == ("b", "d")


def test_the_limit_never_stops_a_running_engine() -> None:
    listed = {"a": S.UNLOADED, "b": S.UNLOADED, "z": S.LOADED}
    decided = plan.decide(listed, ("a", "b"), limit=2)
    assert decided == plan.Plan(start=(), stop=(), left_out=("z",))


def test_the_order_of_the_reply_does_not_matter() -> None:
    one = {"x": S.UNLOADED, "y": S.LOADED, "z": S.UNLOADED}
    other = dict(reversed(list(one.items())))
    assert plan.decide(one, (), limit=2) == plan.decide(other, (), limit=2)


def test_an_unknown_state_parses_as_unknown_and_counts_as_not_running() -> None:
    assert events.ModelStatus.parse("exploding") is S.UNKNOWN
    assert events.ModelStatus.parse("sleeping") is S.SLEEPING
    assert [s.value for s in S if s.running] == ["loading", "loaded", "sleeping"]


def test_the_model_a_request_names_is_read_from_its_json_body() -> None:
    assert admission.named_model(b'{"model": "alpha", "prompt": "x"}') == "alpha"
    for body in (b"", b"not json", b'["alpha"]', b'{"model": 7}', b'{"model": ""}', b'{"prompt": "x"}', b"\xff"):
        assert admission.named_model(body) is None, body
