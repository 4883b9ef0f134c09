"""The launcher's restart decision (pure): never give up on a server that served; end on one that cannot come up."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from sidecar.launch import restarts

SERVED = restarts.Run(ran=5.0, served=True, killed=True)


def fold(runs: list[restarts.Run]) -> restarts.History:
    history = restarts.History()
    for run in runs:
        history = restarts.after(history, run)
    return history


def verdicts(runs: list[restarts.Run], *, jitter: float = 1.0) -> list[restarts.Verdict]:
    history = restarts.History()
    out = []
    for run in runs:
        history = restarts.after(history, run)
        out.append(restarts.decide(history, run, jitter=jitter))
    return out


def test_a_server_killed_every_few_seconds_while_serving_is_restarted_for_ever_with_a_capped_backoff() -> None:
    said = verdicts([SERVED] * 200)
    assert all(v.step is restarts.Step.RESTART for v in said)
    assert [v.delay for v in said[:5]] == [0.0, 0.25, 0.5, 1.0, 2.0]
    assert max(v.delay for v in said) == restarts.MAX_DELAY
    assert not any(v.looping for v in said)


def test_a_run_that_stays_up_ends_the_backoff() -> None:
    long = restarts.Run(ran=restarts.RESET_SECONDS, served=True)
    said = verdicts([SERVED] * 6 + [long, SERVED])
    assert said[5].delay > 0
    assert [v.delay for v in said[6:]] == [0.0, 0.0]


def test_a_first_start_that_exits_on_its_own_ends_the_sidecar_at_once() -> None:
    bad = restarts.Run(ran=0.1, served=False)
    assert verdicts([bad])[0].step is restarts.Step.END


def test_a_first_start_killed_by_sigkill_is_tried_again_until_a_crash_loop() -> None:
    killed = restarts.Run(ran=2.0, served=False, killed=True)
    said = verdicts([killed] * restarts.CRASH_LOOP_EXITS)
    assert [v.step for v in said] == [restarts.Step.RESTART] * (restarts.CRASH_LOOP_EXITS - 1) + [restarts.Step.END]
    assert said[-1].looping


def test_a_server_that_served_then_cannot_come_up_is_a_crash_loop_still_restarted() -> None:
    failing = restarts.Run(ran=0.2, served=False)
    said = verdicts([SERVED, *[failing] * 12, SERVED])
    assert all(v.step is restarts.Step.RESTART for v in said)
    assert [v.looping for v in said[1:]].index(True) == restarts.CRASH_LOOP_EXITS - 1
    assert not said[-1].looping  # it served again


runs_ = st.lists(
    st.builds(
        restarts.Run,
        ran=st.floats(min_value=0, max_value=300),
        served=st.booleans(),
        killed=st.booleans(),
    ),
    min_size=1,
    max_size=60,
)


@given(runs=runs_, jitter=st.floats(min_value=0, max_value=1, exclude_max=True))
def test_once_it_served_it_is_never_given_up_and_the_delay_stays_in_its_bounds(
    runs: list[restarts.Run], jitter: float
) -> None:
    history = restarts.History()
    for i, run in enumerate(runs):
        history = restarts.after(history, run)
        verdict = restarts.decide(history, run, jitter=jitter)
        served_yet = any(r.served for r in runs[: i + 1])
        if served_yet:
            assert verdict.step is restarts.Step.RESTART
        elif not run.killed:
            assert verdict.step is restarts.Step.END
        assert 0.0 <= verdict.delay <= restarts.MAX_DELAY
        if run.ran >= restarts.RESET_SECONDS:
            assert verdict.delay == 0.0  # a run that stayed up restarts at once
        if verdict.delay > 0:
            assert verdict.delay >= restarts.FIRST_DELAY / 2
        tail = 0
        for r in reversed(runs[: i + 1]):
            if r.served:
                break
            tail += 1
        assert verdict.looping == (tail >= restarts.CRASH_LOOP_EXITS)
        if verdict.step is restarts.Step.END:
            break  # the sidecar ended


@given(runs=runs_)
def test_the_history_is_bounded_whatever_the_runs(runs: list[restarts.Run]) -> None:
    history = fold(runs)
    assert history.runs == len(runs)
    assert history.short <= len(runs)
    assert history.unserved <= len(runs)
    assert history.served == any(r.served for r in runs)
