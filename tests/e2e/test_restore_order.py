"""After a kill -9, the restore round restores first the conversation waiting at the gate, on the real server.

Four conversations on 2 slots, their first turns straight to llama-server:
A then C in slot 0, B then D in slot 1, each saved, so C and D are the
slots' newest snapshots and A and B live only in older ones. llama-server
is killed with SIGKILL and started again, and A sends its next turn through
the proxy at once, streamed with the official ``openai`` SDK. Restoring
each slot's newest (slot order) would put C into slot 0 and leave A to a
swap after the round; the round restores A's snapshot first, into slot 0
(the slot it runs in), lets the turn through before the round ends, and
the turn reuses every token of A's snapshot with no swap.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from tests.support import agents
from tests.support.llamabed import MakeServer, make_prompt
from tests.support.sidecarbed import MakeSidecar, SidecarProcess, proxied

WARM = 0.99
"""Share of the earlier prompt (what the restored snapshot holds, answer aside) the turn must reuse."""


def _committed(side: SidecarProcess, slot: int, n: int) -> list[str]:
    """The files of ``slot``'s snapshots committed so far, once there are ``n`` (else empty)."""
    files = [e["file"] for e in side.log_events("snapshot_committed") if e["slot"] == slot]
    return files if len(files) >= n else []


@pytest.mark.timeout(600)
def test_the_conversation_waiting_after_a_kill9_is_restored_first_into_its_slot_and_runs_warm_without_a_swap(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    server = llama(slot_dir=slot_dir, n_slots=2, ctx_size=8192)
    side, url = proxied(sidecar, server, slot_dir, {"--idle-seconds": "0.2"})
    api = agents.Chat(url, stream=True)
    chats = [agents.Conversation.start(n, make_prompt(server.url, 1000, seed=820 + n)) for n in range(4)]
    files: dict[int, list[str]] = {}
    for n, chat in enumerate(chats):  # A, B, C, D into slots 0, 1, 0, 1
        slot = n % 2
        agents.first_turn_direct(server.url, api, chat, slot)
        files[slot] = side.wait_for(
            functools.partial(_committed, side, slot, n // 2 + 1), timeout=60, what=f"slot {slot}'s snapshot {n}"
        )
    a_file, c_file = files[0][-2], files[0][-1]
    restored_before = len(side.log_events("slot_restored"))
    opened_before = len(side.log_events("restore_gate_open"))
    swapped_before = len(side.log_events("conversation_swapped_in"))
    a = chats[0]
    earlier = a.prompt
    reply = agents.sent_across_a_kill9(side, server, api, a)
    side.wait_for(lambda: len(side.log_events("slot_restored")) >= restored_before + 2, what="both slots restored")
    side.wait_for(lambda: len(side.log_events("restore_gate_open")) > opened_before, what="the gate's opening")
    restored = [(e["slot"], e["file"]) for e in side.log_events("slot_restored")[restored_before:]]
    opened = side.log_events("restore_gate_open")[opened_before:]
    swaps = side.log_events("conversation_swapped_in")[swapped_before:]
    print(f"cache_n {reply.cached} of {reply.prompt} (earlier {earlier}); restored {restored}; swaps {len(swaps)}")
    assert restored[0] == (0, a_file), f"A ({a_file}) was not restored first into slot 0: {restored}"
    assert c_file not in {file for _, file in restored[:1]}
    assert [e.get("early") for e in opened][-1:] == [1], f"the turn was not let through early: {opened}"
    assert reply.cached >= WARM * earlier, (reply.cached, earlier, "the turn did not reuse A's snapshot")
    assert not swaps, f"the turn needed a swap after the round: {swaps}"
