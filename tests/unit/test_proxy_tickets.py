"""A proxied request's admission: each move of its stage, the ones the rules refuse, and what a loss or a closed
gate leads to. No I/O."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.proxy import tickets

S = tickets.Stage
M = tickets.Move


def table(rows: str) -> dict[tuple[S, M], S]:
    """Moves written one per line as ``stage move stage``; every stage but ``released`` may be released."""
    moves = {(S(a), M(b)): S(c) for a, b, c in (line.split() for line in rows.strip().splitlines())}
    return moves | {(stage, M.RELEASE): S.RELEASED for stage in S if stage is not S.RELEASED}


ROUTED = table(
    """
    held      let_through placing
    placing   reserve     placing
    placing   unreserve   placing
    placing   place       placed
    placing   later       held
    placed    send        forwarded
    forwarded send        forwarded
    held      closed      held
    placed    closed      held
    forwarded closed      held
    forwarded first_event relaying
    """
)
"""Every move a routed request may make, written out by hand: held, placed, sent, relayed, released."""
NOT_ROUTED = table(
    """
    held      send        forwarded
    forwarded send        forwarded
    held      closed      held
    forwarded closed      held
    forwarded first_event relaying
    """
)
"""Every move a request the library does not place may make: it is sent straight from the gate."""


@pytest.mark.parametrize(("routed", "table"), [(True, ROUTED), (False, NOT_ROUTED)])
def test_each_allowed_move_leads_where_the_table_says(routed: bool, table: dict[tuple[S, M], S]) -> None:
    for (stage, move), target in table.items():
        assert tickets.after(stage, move, routed=routed) is target, (stage, move)


@pytest.mark.parametrize(("routed", "table"), [(True, ROUTED), (False, NOT_ROUTED)])
def test_every_other_move_is_refused(routed: bool, table: dict[tuple[S, M], S]) -> None:
    refused = [pair for pair in itertools.product(S, M) if pair not in table]
    assert (S.RELEASED, M.RELEASE) in refused  # released once only
    assert (S.RELAYING, M.SEND) in refused  # a byte reached the client: never sent again
    assert (S.HELD, M.SEND) in refused or not routed  # a routed request is placed before it is sent
    for stage, move in refused:
        with pytest.raises(tickets.IllegalMove):
            tickets.after(stage, move, routed=routed)


def state(ticket: tickets.Ticket) -> tuple[S, int | None, frozenset[int] | None]:
    """Where ``ticket`` is: its stage, the slot it holds, the slots it may be placed in."""
    return ticket.stage, ticket.slot, ticket.within


def test_a_routed_request_goes_from_the_gate_through_its_slot_to_its_release() -> None:
    ticket = tickets.Ticket(deadline=10.0)
    assert state(ticket) == (S.HELD, None, None)
    assert ticket.prepares  # reads its token ids while it waits
    ticket.let_through(frozenset({0, 2}))
    assert state(ticket) == (S.PLACING, None, frozenset({0, 2}))
    ticket.reserve(2)
    assert state(ticket) == (S.PLACING, 2, frozenset({0, 2}))
    ticket.place()
    assert state(ticket) == (S.PLACED, 2, frozenset({0, 2}))
    ticket.send()
    assert state(ticket) == (S.FORWARDED, 2, frozenset({0, 2}))
    ticket.first_event()
    assert state(ticket) == (S.RELAYING, 2, frozenset({0, 2}))
    ticket.release()
    assert state(ticket) == (S.RELEASED, None, None)
    with pytest.raises(tickets.IllegalMove):
        ticket.release()


def test_a_closed_gate_has_a_routed_request_placed_again_holding_no_slot_and_any_other_wait() -> None:
    routed = tickets.Ticket()
    routed.let_through(None)
    routed.reserve(1)
    routed.place()
    routed.send()
    assert routed.closed() is tickets.Resume.REPLACE
    assert (routed.stage, routed.slot) == (S.HELD, None)
    routed.let_through(None)  # placed again once the gate opens
    routed.reserve(0)
    assert routed.slot == 0

    plain = tickets.Ticket(routed=False)
    plain.send()
    assert plain.closed() is tickets.Resume.WAIT
    plain.send()  # sent again as it is, no placement
    assert plain.stage == S.FORWARDED


def test_a_request_let_through_early_but_not_placed_waits_for_the_whole_round_without_preparing_again() -> None:
    ticket = tickets.Ticket()
    ticket.let_through(frozenset({0}))
    ticket.later()
    assert (ticket.stage, ticket.within, ticket.prepares) == (S.HELD, None, False)
    ticket.let_through(None)
    ticket.place()
    assert ticket.prepares  # placed: a wait at a gate that closes again reads its token ids anew


def test_a_slot_is_reserved_once_and_never_by_a_request_that_waits_for_the_round() -> None:
    ticket = tickets.Ticket()
    ticket.let_through(frozenset({0}))
    ticket.reserve(0)
    with pytest.raises(tickets.IllegalMove):
        ticket.reserve(1)
    with pytest.raises(tickets.IllegalMove):
        ticket.later()
    ticket.unreserve()  # a failed swap: it goes as it came
    assert ticket.slot is None
    ticket.later()


def test_a_request_the_library_does_not_place_makes_no_placement_move() -> None:
    ticket = tickets.Ticket(routed=False)
    for move in (ticket.place, ticket.unreserve, lambda: ticket.let_through(None), lambda: ticket.reserve(0)):
        with pytest.raises(tickets.IllegalMove):
            move()
    assert ticket.stage is S.HELD


@pytest.mark.parametrize(
    ("gated", "expected"),
    [
        (True, [tickets.Replay.RESEND, tickets.Replay.SUSPECT, tickets.Replay.GIVE_UP]),
        (False, [tickets.Replay.RESEND, tickets.Replay.GIVE_UP]),
    ],
)
def test_a_lost_connection_is_sent_again_then_suspected_then_given_up(
    gated: bool, expected: list[tickets.Replay]
) -> None:
    ticket = tickets.Ticket(routed=False, gated=gated)
    seen = []
    for _ in expected:
        ticket.send()
        seen.append(ticket.lost())
    assert seen == expected


def test_a_loss_counts_only_for_a_request_sent_and_not_yet_answered() -> None:
    ticket = tickets.Ticket(routed=False)
    with pytest.raises(tickets.IllegalMove):
        ticket.lost()  # never sent
    ticket.send()
    ticket.first_event()
    with pytest.raises(tickets.IllegalMove):
        ticket.lost()  # the client has bytes: nothing is replayed


_CALLS = {
    M.LET_THROUGH: lambda t: t.let_through(None),
    M.RESERVE: lambda t: t.reserve(3),
    M.UNRESERVE: lambda t: t.unreserve(),
    M.PLACE: lambda t: t.place(),
    M.LATER: lambda t: t.later(),
    M.SEND: lambda t: t.send(),
    M.CLOSED: lambda t: t.closed(),
    M.FIRST_EVENT: lambda t: t.first_event(),
    M.RELEASE: lambda t: t.release(),
}


@given(st.booleans(), st.lists(st.sampled_from(list(M)), max_size=30))
def test_whatever_moves_are_tried_a_slot_is_held_only_between_the_gate_and_the_release(
    routed: bool, moves: list[M]
) -> None:
    ticket = tickets.Ticket(routed=routed)
    for move in moves:
        before = ticket.stage
        try:
            _CALLS[move](ticket)
        except tickets.IllegalMove:
            assert ticket.stage is before  # a refused move changes nothing
        if ticket.slot is not None:
            assert routed
            assert ticket.stage in (S.PLACING, S.PLACED, S.FORWARDED, S.RELAYING)
        if ticket.stage is S.RELEASED:
            assert ticket.slot is None
