"""--sleep-idle-seconds: the sidecar lets the server sleep, and refills idle slots when it wakes."""

from __future__ import annotations

import time
from pathlib import Path

from tests.support.llamabed import MakeServer, complete, http_json, make_prompt
from tests.support.sidecarbed import MakeSidecar

TOKENS = 1024


def _sleeping(url: str) -> bool:
    return bool(http_json("GET", url + "/props")[1].get("is_sleeping"))


def test_sleeping_server_is_left_asleep_and_idle_slots_come_back_when_it_wakes(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    server = llama(slot_dir=slot_dir, n_slots=2, ctx_size=4096, extra_args=["--sleep-idle-seconds", "4"])
    side = sidecar(server, slot_dir)
    first = make_prompt(server.url, TOKENS, seed=61)
    complete(server.url, first, id_slot=0)
    side.wait_saved()
    side.wait_for(lambda: side.log_events("server_sleeping"), timeout=30, what="the server falling asleep")
    time.sleep(3)  # a dozen polls: none of them may wake the server or count as a restart
    assert _sleeping(server.url)
    assert side.metric("llama_sidecar_server_restarts_total") == 0
    assert side.metric("llama_sidecar_restores_total", slot="0", result="ok") == 0

    complete(server.url, make_prompt(server.url, 300, seed=62), id_slot=1)  # a request wakes it
    side.wait_restored()
    assert side.log_events("server_woke")
    warm = complete(server.url, first + " after the nap", id_slot=0)
    assert warm["timings"]["cache_n"] >= 0.95 * TOKENS
