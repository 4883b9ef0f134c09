"""Routing a request to its KV, and letting conversations go: pure decisions on hand-made chains."""

from __future__ import annotations

import itertools

from sidecar.core import outcomes
from sidecar.library import routing
from sidecar.snapshots import retention


def chain(name: str, n: int) -> tuple[str, ...]:
    """A hash chain of ``n`` blocks; chains of the same name share their prefixes."""
    return tuple(f"{name}{i}" for i in range(n))


def held(
    slot: int, prefix: tuple[str, ...] = (), *, busy: bool = False, used: float = 0.0, dirty: bool = False
) -> routing.Held:
    return routing.Held(slot, prefix, busy, used, dirty)


def test_request_goes_to_the_slot_holding_its_prefix() -> None:
    slots = [held(0, chain("a", 5), used=9.0), held(1, chain("b", 8), used=1.0)]
    got = routing.route(chain("b", 9), slots, [routing.Entry("b.bin", chain("b", 8))])
    assert (got.source, got.slot, got.blocks) == (outcomes.Source.SLOT, 1, 8)


def test_another_conversation_sharing_only_a_prefix_saves_what_the_slot_held_past_it_first() -> None:
    system = chain("sys", 8)
    other = (*system, *chain("other", 6))  # an agent's conversation on the same system prompt, unsaved
    request = (*system, *chain("mine", 3))
    d = routing.route(request, [held(0, other, dirty=True)], [])
    assert (d.source, d.slot, d.blocks, d.save_first) == (outcomes.Source.SLOT, 0, 8, True)
    assert not routing.route(request, [held(0, other, dirty=False)], []).save_first  # saved already


def test_the_slots_own_next_turn_saves_nothing_first_though_it_drops_the_slots_last_block() -> None:
    turns = chain("c", 10)
    request = (*turns[:9], *chain("next", 2))  # the slot's last block held the reply as generated
    slot = routing.Held(0, turns, False, 0.0, True, continued=True)
    d = routing.route(request, [slot], [])
    assert (d.source, d.blocks, d.save_first) == (outcomes.Source.SLOT, 9, False)
    assert routing.route(request, [held(0, turns, dirty=True)], []).save_first  # not known to continue it


def test_a_busy_slot_holding_the_prefix_is_waited_for_not_pinned_nor_left_for_a_cold_start() -> None:
    slots = [held(0, chain("a", 5), busy=True), held(1)]
    got = routing.route(chain("a", 6), slots, [])
    assert (got.source, got.slot, got.blocks) == (outcomes.Source.SLOT, None, 5)  # held until slot 0 frees


def test_a_request_is_never_pinned_to_a_busy_slot() -> None:
    """Pinned to a slot a request runs in, it would run over what that request leaves, which no snapshot holds
    yet: whatever the slots and the library hold, a decision names an idle slot or none (held until one frees)."""
    shapes = [(), chain("a", 3), chain("a", 6), chain("b", 4), (*chain("a", 2), *chain("x", 4))]
    library = [[], [routing.Entry("a.bin", chain("a", 8))], [routing.Entry("b.bin", chain("b", 9))]]
    ram = [None, routing.Entry("", chain("a", 7))]
    held_back = 0
    for first, second in itertools.product(shapes, repeat=2):
        for busy in itertools.product((False, True), repeat=2):
            slots = [held(0, first, busy=busy[0], dirty=True), held(1, second, busy=busy[1], used=1.0, dirty=True)]
            for entries, in_ram in itertools.product(library, ram):
                got = routing.route(chain("a", 9), slots, entries, ram=in_ram)
                assert got.slot is None or not slots[got.slot].busy, (slots, entries, in_ram, got)
                held_back += got.slot is None
                if not all(busy):
                    continue
                assert got.slot is None, "every slot busy: nothing pinned, nothing sent unpinned either"
    assert held_back > 0


def test_library_prefix_is_swapped_into_the_least_recently_used_idle_slot() -> None:
    slots = [held(0, chain("x", 3), used=5.0, dirty=True), held(1, chain("y", 3), used=2.0, dirty=True)]
    got = routing.route(chain("c", 10), slots, [routing.Entry("c.bin", chain("c", 9))])
    assert got.source is outcomes.Source.LIBRARY
    assert got.slot == 1
    assert got.entry == routing.Entry("c.bin", chain("c", 9))
    assert got.save_first  # slot 1 changed since its snapshot: save it before it is replaced
    assert got.blocks == 9


def test_an_empty_slot_is_taken_before_one_holding_a_conversation() -> None:
    slots = [held(0, chain("x", 3), used=0.0), held(1, (), used=50.0)]
    got = routing.route(chain("c", 10), slots, [routing.Entry("c.bin", chain("c", 9))])
    assert (got.slot, got.save_first) == (1, False)


def test_a_marginal_library_gain_is_not_worth_a_swap() -> None:
    slots = [held(0, chain("c", 8))]
    got = routing.route(chain("c", 12), slots, [routing.Entry("c.bin", chain("c", 9))], min_gain_blocks=2)
    assert (got.source, got.slot) == (outcomes.Source.SLOT, 0)


def test_of_two_library_entries_the_longer_shared_prefix_wins_then_the_smaller_file() -> None:
    entries = [routing.Entry("long.bin", chain("c", 20)), routing.Entry("short.bin", chain("c", 6))]
    got = routing.route((*chain("c", 6), "z"), [held(0)], entries)
    assert got.entry == routing.Entry("short.bin", chain("c", 6))


def test_new_conversation_is_pinned_to_the_least_recently_used_idle_slot() -> None:
    slots = [held(0, chain("a", 2), used=7.0), held(1, chain("b", 2), used=3.0), held(2, busy=True)]
    got = routing.route(chain("n", 4), slots, [routing.Entry("a.bin", chain("a", 2))])
    assert (got.source, got.slot) == (outcomes.Source.COLD, 1)


def test_every_slot_busy_pins_nothing() -> None:
    slots = [held(0, chain("a", 2), busy=True)]
    got = routing.route(chain("c", 4), slots, [routing.Entry("c.bin", chain("c", 4))])
    assert (got.source, got.slot) == (outcomes.Source.COLD, None)


def kept(file: str, prefix: tuple[str, ...], *, gen: int, used: float = 0.0, size: int = 10) -> retention.Kept:
    return retention.Kept(file, prefix, size, gen, used)


def test_an_older_prefix_of_a_newer_snapshot_is_superseded() -> None:
    old, new = kept("old", chain("a", 3), gen=1), kept("new", chain("a", 5), gen=2)
    other = kept("other", chain("b", 3), gen=0)
    got = retention.select([old, new, other], in_use=(), max_bytes=0, max_age=0, now=0)
    assert got == [(old, outcomes.GcReason.SUPERSEDED)]


def test_a_newer_shorter_snapshot_does_not_supersede_a_longer_one() -> None:
    longer, shorter = kept("long", chain("a", 5), gen=1), kept("short", chain("a", 3), gen=2)
    assert retention.select([longer, shorter], in_use=(), max_bytes=0, max_age=0, now=0) == []


def test_least_recently_used_go_first_under_the_byte_cap_and_in_use_is_kept() -> None:
    a = kept("a", chain("a", 1), gen=1, used=1.0)
    b = kept("b", chain("b", 1), gen=2, used=2.0)
    c = kept("c", chain("c", 1), gen=3, used=3.0)
    got = retention.select([a, b, c], in_use={"a"}, max_bytes=20, max_age=0, now=10)
    assert got == [(b, outcomes.GcReason.BYTES)]


def test_conversations_unused_for_max_age_go() -> None:
    a = kept("a", chain("a", 1), gen=1, used=1.0)
    b = kept("b", chain("b", 1), gen=2, used=95.0)
    got = retention.select([a, b], in_use=(), max_bytes=0, max_age=10, now=100)
    assert got == [(a, outcomes.GcReason.AGE)]


def test_a_shared_prefix_must_beat_both_the_slots_and_the_library_to_be_fetched() -> None:
    slots = [held(0, chain("a", 5), used=9.0), held(1, chain("b", 2), used=1.0, dirty=True)]
    library = [routing.Entry("a.bin", chain("a", 7))]
    got = routing.route(chain("a", 9), slots, library, shared=routing.Entry("blobs/a", chain("a", 9)))
    assert (got.source, got.slot, got.blocks, got.save_first) == (outcomes.Source.SHARED, 1, 9, True)
    assert got.entry is not None
    assert got.entry.file == "blobs/a"
    marginal = routing.route(chain("a", 9), slots, library, shared=routing.Entry("blobs/a", chain("a", 7)))
    assert (marginal.source, marginal.slot) == (outcomes.Source.LIBRARY, 1)


def test_a_shared_prefix_with_no_idle_slot_to_fetch_into_is_not_fetched() -> None:
    slots = [held(0, chain("a", 2), busy=True)]
    got = routing.route(chain("a", 9), slots, [], shared=routing.Entry("blobs/a", chain("a", 9)))
    assert (got.source, got.slot) == (outcomes.Source.SLOT, None)  # held until slot 0 frees


def test_of_two_snapshots_as_long_in_blocks_the_one_holding_more_of_the_request_is_restored() -> None:
    """Two turns of one conversation saved 74 tokens apart, both 4 whole blocks (seen in a soak: the older one,
    first in the library, was restored and the turn reused 1,046 of 1,120 tokens)."""
    slots = [held(0), held(1)]
    older = routing.Entry("older.bin", chain("c", 4), exact_tokens=1046)
    newer = routing.Entry("newer.bin", chain("c", 4), exact_tokens=1120)
    for library in ([older, newer], [newer, older]):
        got = routing.route(chain("c", 5), slots, library)
        assert (got.source, got.entry) == (outcomes.Source.LIBRARY, newer)
    branch = routing.Entry("branch.bin", (*chain("c", 4), "x"), exact_tokens=2000)  # went on elsewhere
    got = routing.route(chain("c", 5), slots, [branch, older])
    assert got.entry == older
