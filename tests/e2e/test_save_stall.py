"""A save past its hold is weighed against the stall it costs, on a real llama-server with an 8B-class KV.

A save writes the whole slot while every slot waits; past ``--save-hold-seconds`` a due save made
while another slot generates is worth it only if what a crash would lose (the slot's tokens past its
last snapshot, re-prefilled at the server's measured rate) costs at least that stall, or more than
``--max-unsaved-seconds``. The 8B-class KV makes the stall real (about 0.4 s per 1,000 tokens here).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support import streams, widekv
from tests.support.llamabed import MakeServer, complete, make_prompt, slots
from tests.support.sidecarbed import MakeSidecar, SidecarProcess

HELD = "llama_sidecar_snapshots_held_total"


def _saves_of(side: SidecarProcess, slot: int) -> list[dict[str, Any]]:
    """The server saves of ``slot`` made while another slot generated (their commit waits)."""
    return [e for e in side.log_events("snapshot_commit_deferred") if e["slot"] == slot]


def test_a_save_past_its_hold_waits_while_its_tail_re_prefills_faster_than_it_stalls_every_slot(
    llama: MakeServer, sidecar: MakeSidecar, model: Path, slot_dir: Path, figure: Callable[[str], None]
) -> None:
    wide = widekv.model(tokenizer_from=model)
    server = llama(slot_dir=slot_dir, n_slots=2, model=wide, ctx_size=8192, swa_full=False)
    side = sidecar(server, slot_dir, extra={"--save-hold-seconds": "2", "--idle-seconds": "1.0"})
    convo = make_prompt(server.url, 1000, seed=71)
    complete(server.url, convo, n_predict=1, id_slot=1)
    side.wait_saved(slot=1, timeout=120)  # no other slot processing: saved at once, its stall measured
    stream = streams.Stream(server.port, 0, "Count on:")
    try:
        side.wait_for(lambda: slots(server.url)[0]["is_processing"], timeout=30, what="slot 0 generating")

        convo += " One"  # a tail of a token or two
        complete(server.url, convo, n_predict=1, id_slot=1)
        side.wait_for(lambda: side.metric(HELD, reason="cheap_tail") >= 1, timeout=30, what="the save weighed, held")
        stall = side.metric("llama_sidecar_slot_save_expected_stall_seconds", slot="1")
        small = side.metric("llama_sidecar_slot_unsaved_reprefill_seconds", slot="1")
        assert _saves_of(side, 1) == []
        assert 0 < small < stall
        assert stream.running, "slot 0 stopped generating: the save was not weighed against a stall"

        convo += " " + make_prompt(server.url, 400, seed=72)  # a tail that re-prefills slower than a save stalls
        complete(server.url, convo, n_predict=1, id_slot=1)
        saved = side.wait_for(lambda: _saves_of(side, 1), timeout=60, what="slot 1 saved while slot 0 generates")
        assert slots(server.url)[0]["is_processing"], "slot 0 stopped generating: the save did not stall it"
        figure(
            f"8B-class KV, slot 0 generating: a tail re-prefilling in {small:.3f} s held past the hold (a save "
            f"expected to stall {stall:.3f} s); {saved[0]['tokens']} tokens saved once 400 more came, the "
            f"save call {saved[0]['seconds']:.3f} s"
        )
    finally:
        stream.stop()
