"""The model of llama-server's RAM prompt cache, and routing to it: pure decisions on hand-made chains."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from sidecar.core import outcomes
from sidecar.library import prompt, ramtier, routing, turns
from tests.unit.test_library_decisions import chain, held

MIB = 1 << 20


def test_a_conversation_that_left_its_slot_is_found_for_its_owner_only() -> None:
    ram = ramtier.RamTier(100 * MIB)
    ram.left("alice", chain("a", 6), 10 * MIB)
    found, blocks = ram.best("alice", chain("a", 9))
    assert found is not None
    assert (found.chain, blocks) == (chain("a", 6), 6)
    assert ram.best("bob", chain("a", 9)) == (None, 0)
    ram.loaded(found)  # the server moved it into a slot
    assert ram.best("alice", chain("a", 9)) == (None, 0)


def test_the_oldest_go_first_past_the_servers_size_as_llama_server_drops_them() -> None:
    ram = ramtier.RamTier(30 * MIB)
    for name in "abcd":
        ram.left("", chain(name, 4), 10 * MIB)
    assert ram.best("", chain("a", 4)) == (None, 0)
    assert [ram.best("", chain(n, 4))[1] for n in "bcd"] == [4, 4, 4]
    assert ram.bytes == 30 * MIB
    ram.left("", chain("e", 4), 40 * MIB)  # larger than the whole cache: the server keeps none of it
    assert ram.best("", chain("e", 4)) == (None, 0)


def test_a_longer_copy_replaces_its_prefix_and_a_shorter_one_is_not_copied() -> None:
    ram = ramtier.RamTier(100 * MIB)
    ram.left("", chain("a", 4), 4 * MIB)
    ram.left("", chain("a", 6), 6 * MIB)
    assert (len(ram), ram.bytes) == (1, 6 * MIB)
    ram.left("", chain("a", 5), 5 * MIB)
    assert (len(ram), ram.bytes) == (1, 6 * MIB)


def _state(ram: ramtier.RamTier) -> ramtier.State:
    """Read anew each time (mypy would narrow the attribute after the first assert)."""
    return ram.state


def test_it_is_trusted_once_shown_off_once_wrong_and_tried_again_after_a_restart() -> None:
    ram = ramtier.RamTier(100 * MIB)
    assert _state(ram) is ramtier.State.TRYING
    ram.served()
    assert _state(ram) is ramtier.State.CONFIRMED
    ram.left("", chain("a", 4), MIB)
    ram.missed()
    assert _state(ram) is ramtier.State.OFF
    assert len(ram) == 0
    ram.left("", chain("a", 4), MIB)
    assert len(ram) == 0  # off: nothing is counted on
    ram.restarted()
    assert _state(ram) is ramtier.State.TRYING
    assert ramtier.RamTier(0).state is ramtier.State.OFF


def test_routing_takes_ram_over_the_library_where_it_holds_as_much_and_leaves_a_slot_holding_it() -> None:
    slots = [held(0, chain("x", 3), used=5.0, dirty=True), held(1, chain("y", 3), used=2.0)]
    library = [routing.Entry("c.bin", chain("c", 9))]
    got = routing.route(chain("c", 10), slots, library, ram=routing.Entry("", chain("c", 9)))
    assert (got.source, got.slot, got.blocks, got.save_first) == (outcomes.Source.RAM, 1, 9, False)
    got = routing.route(chain("c", 10), slots, library, ram=routing.Entry("", chain("c", 7)))
    assert got.source is outcomes.Source.LIBRARY  # the library holds more of it
    slots = [held(0, chain("c", 9)), held(1)]
    got = routing.route(chain("c", 10), slots, library, ram=routing.Entry("", chain("c", 9)))
    assert (got.source, got.slot) == (outcomes.Source.SLOT, 0)


@given(
    sizes=st.lists(st.tuples(st.sampled_from("abcdef"), st.integers(1, 8), st.integers(1, 40)), max_size=40),
    capacity=st.integers(1, 100),
)
def test_what_it_holds_never_exceeds_the_servers_size(sizes: list[tuple[str, int, int]], capacity: int) -> None:
    ram = ramtier.RamTier(capacity * MIB)
    for name, blocks, size in sizes:
        ram.left(name[0], chain(name, blocks), size * MIB)
        assert ram.bytes <= capacity * MIB
        assert ram.bytes >= 0


def _key(*messages: str) -> turns.Key:
    body = {"messages": [{"role": "user", "content": m} for m in messages]}
    request = prompt.of("/v1/chat/completions", json.dumps(body).encode())
    assert isinstance(request, prompt.Prompt)
    key = turns.of(request)
    assert key is not None
    return key


def test_a_request_that_continues_a_conversation_in_ram_finds_it_by_its_turn_alone() -> None:
    ram = ramtier.RamTier(100 * MIB)
    ram.left("alice", chain("a", 4), MIB, _key("hi"))
    ram.left("alice", chain("a", 6), 2 * MIB, _key("hi", "more", "again"))  # the same one, longer: replaces it
    ram.left("alice", chain("b", 5), MIB, _key("other"))
    ram.left("alice", chain("c", 5), MIB)  # left with no turn known: found by its ids only
    found = ram.continued("alice", _key("hi", "more", "again", "ok", "next"))
    assert found is not None
    assert found.chain == chain("a", 6)
    assert ram.continued("bob", _key("hi", "more", "again", "ok", "next")) is None  # another owner's
    assert ram.continued("alice", _key("hi", "edited", "again", "ok")) is None  # history edited: by its ids
    assert ram.continued("alice", _key("other", "ok", "then")) == ram.best("alice", chain("b", 5))[0]
    ram.missed()
    assert ram.continued("alice", _key("other", "ok", "then")) is None  # the cache showed itself wrong: off
