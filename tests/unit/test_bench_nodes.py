"""The nodes bench's time goal after a kill -9: judged on agents' turns, the short ones printed as the worst case."""

from __future__ import annotations

import dataclasses

import pytest

from bench import nodes, nodes_result, nodes_steps


def _chat(n: int, node_before: str, seconds: float, *, agent: bool = False, slower: float = 0.0) -> nodes_steps.Chat:
    """``slower``: seconds the turn's generation took more than its neighbours' (the machine's load, not the move)."""
    chat = nodes_steps.Chat(n, "first", answer_tokens=nodes_result.ANSWER_TOKENS if agent else None)
    chat.nodes = [node_before, "node-b"]
    chat.seconds = [1.0, seconds + slower]
    chat.server_seconds = [0.9, seconds + slower - 0.05]
    generating = 1.0 if agent else 0.1
    chat.generation_seconds = [generating, generating + slower]
    chat.prompts = [1000, 1100]
    chat.cached = [0, 1000]
    chat.fetched = [False, node_before == "node-a"]
    chat.answered = [4, nodes_result.ANSWER_TOKENS if agent else 4]
    return chat


def _result(short: float, agent: float, *, slower: float = 0.0) -> nodes_result.Result:
    """Short turns of 0.2 s and agents' turns of 2 s that stayed; the moved ones ``short`` and ``agent`` times
    theirs, sent in one round mixed together (``slower``: the moved agent's generation took that much longer)."""
    brief = [_chat(0, "node-a", 0.2 * short), _chat(1, "node-b", 0.2), _chat(2, "node-b", 0.2)]
    agents = [_chat(0, "node-a", 2.0 * agent, agent=True, slower=slower), _chat(1, "node-b", 2.0, agent=True)]
    sent = [brief[1], agents[1], brief[0], agents[0], brief[2]]
    steps = [{"placement": 0.01} for _ in sent]
    kills = {
        name: nodes_steps.kill(sent, kind, "node-a", 1, steps) for name, kind in (("short", brief), ("agents", agents))
    }
    phase = nodes_result.Phase(nodes_result.SHIPPED, {"node-a": 1, "node-b": 2}, 3, 3, 0, 1.0)
    short_kill = kills["short"]
    return nodes_result.Result(
        3, 1, [phase, phase], "node-a", short_kill.moved_reused, short_kill.moved_fetched,
        short_kill.moved_seconds, short_kill.stayed_seconds, [1.0], short_kill.moved_server_seconds,
        short_kill.stayed_server_seconds, short_kill.moved_steps, short_kill.stayed_placing, {"node-a": 4, "node-b": 4},
        1.5, short_kill.paired, kills["agents"], "load 1.00", short_kill,
    )  # fmt: skip


def _time_line(result: nodes_result.Result) -> str:
    return next(line for line in nodes.verdicts(result) if "without a failure" in line)


def test_each_moved_turn_is_paired_with_the_turns_of_its_own_kind_that_stayed_beside_it() -> None:
    result = _result(short=1.7, agent=1.1)
    assert result.paired == [1.7]
    assert result.agents is not None
    assert result.agents.paired == [1.1]
    assert len(result.agents.moved_seconds) == 1
    assert len(result.agents.stayed_seconds) == 1
    assert result.agents.answer_tokens == nodes_result.ANSWER_TOKENS


def test_the_time_goal_is_the_agents_turns_and_the_short_turns_are_printed_as_the_worst_case() -> None:
    line = _time_line(_result(short=1.7, agent=1.1))
    assert line.startswith("MET ")
    assert "1.10x with the same generation time (1.10x as timed; short turns, the worst case, no goal: 1.70x" in line


def test_a_generation_slowed_by_the_machine_is_not_counted_as_the_moves_cost() -> None:
    result = _result(short=1.0, agent=1.1, slower=2.0)  # the moved turn generated 2 s slower than its neighbour
    assert result.agents is not None
    assert result.agents.paired == [2.1]
    assert result.agents.same_ratio == pytest.approx(1.1)
    line = _time_line(result)
    assert line.startswith("MET "), line
    assert "(2.10x as timed" in line


def test_what_the_move_adds_outside_the_generation_still_counts() -> None:
    line = _time_line(_result(short=1.0, agent=1.6, slower=-0.5))  # generated faster: the move's 1.2 s remains
    assert line.startswith("MISSED "), line


def test_an_agents_turn_slowed_past_the_goal_by_the_move_is_missed() -> None:
    line = _time_line(_result(short=1.1, agent=1.6))
    assert line.startswith("MISSED ")


def test_a_run_without_agents_turns_is_missed_not_excused() -> None:
    result = dataclasses.replace(_result(short=1.1, agent=1.1), agents=None)
    assert _time_line(result).startswith("MISSED ")


def test_the_table_shows_both_kinds_side_by_side_with_the_load_at_the_kill() -> None:
    text = nodes.table(_result(short=1.7, agent=1.1))
    assert "short turns, moved" in text
    assert "agents' turns, stayed" in text
    assert "load 1.00 at the kill" in text
