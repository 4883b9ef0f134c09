"""Slot actions and busy slots against the real server: nothing is sent to a busy slot, polling never stops.

llama-server holds a slot action on a processing slot until that slot's
request ends. A save sent to a generating slot used to hold the sidecar's
only loop for the whole generation: nothing else was observed or saved.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from support.llamabed import LlamaHTTPError, MakeServer, call, complete, make_prompt, slots
from support.sidecarbed import MakeSidecar, SidecarProcess

TOKEN = "admin-secret"
LONG_GENERATION = 6000
"""Tokens slot 1 generates (ignoring end-of-text): far longer than the test's steps take."""


def _generate(url: str, prompt: str, outcome: dict[str, Any]) -> None:
    body = {"prompt": prompt, "n_predict": LONG_GENERATION, "ignore_eos": True, "temperature": 0, "id_slot": 1}
    try:
        outcome["reply"] = call("POST", url + "/completion", body)
    except (LlamaHTTPError, OSError) as exc:  # the server is killed at teardown
        outcome["error"] = exc


def _admin_snapshot(side: SidecarProcess, slot: int) -> tuple[int, dict[str, Any], float]:
    req = urllib.request.Request(
        f"{side.url}/snapshot?slot={slot}", data=b"", method="POST", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    started = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=600) as resp:
            status, raw = int(resp.status), resp.read()
    except urllib.error.HTTPError as err:
        status, raw = int(err.code), err.read()
    return status, json.loads(raw), time.monotonic() - started


def _status_slot(side: SidecarProcess, slot: int) -> dict[str, Any]:
    return next(v for v in side.status()["slots"] if v["id"] == slot)


def test_a_long_generation_neither_receives_a_save_nor_stops_the_polls(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    server = llama(slot_dir=slot_dir, n_slots=2, ctx_size=8192)
    side = sidecar(server, slot_dir, extra={"--admin-token": TOKEN, "--idle-seconds": "1.0"})
    side.wait_for(lambda: side.status()["server"]["slot_dir_linked"] is True, what="slot dir linked")
    outcome: dict[str, Any] = {}
    generation = threading.Thread(
        target=_generate, args=(server.url, make_prompt(server.url, 200, seed=41), outcome), daemon=True
    )
    generation.start()
    side.wait_for(lambda: _status_slot(side, 1)["processing"], what="slot 1 generating, as the sidecar sees it")

    # An admin asks for a save of the generating slot: refused at once, nothing sent to the server.
    status, body, seconds = _admin_snapshot(side, 1)
    print(f"admin save of the generating slot answered {status} in {seconds:.3f} s: {body['result']}")
    assert generation.is_alive(), "the generation ended before the test could use it: raise LONG_GENERATION"
    assert status == 500
    assert body["result"]["result"] == "skipped"
    assert body["result"]["cause"] == "slot_busy"
    assert seconds < 5.0

    # Two turns on slot 0 during the generation: the sidecar keeps observing, through both.
    prompt = make_prompt(server.url, 300, seed=42)
    first = complete(server.url, prompt, n_predict=4, id_slot=0)
    first_tokens = first["timings"]["prompt_n"] + first["timings"]["cache_n"]
    side.wait_for(lambda: _status_slot(side, 0)["tokens"] >= first_tokens, what="slot 0's first turn seen")
    side.wait_for(  # slot 0 is due for a save: saved, or held until slot 1 is done
        lambda: (
            side.metric("llama_sidecar_snapshots_total", slot="0", result="ok") >= 1
            or any(e.get("slot") == 0 for e in side.log_events("snapshot_held"))
        ),
        what="slot 0's save taken or held",
    )
    second = complete(server.url, prompt + " and the next question", n_predict=4, id_slot=0)
    second_tokens = second["timings"]["prompt_n"] + second["timings"]["cache_n"]
    started = time.monotonic()
    side.wait_for(
        lambda: _status_slot(side, 0)["tokens"] >= second_tokens, timeout=10.0, what="slot 0's second turn seen"
    )
    print(f"slot 0's second turn seen {time.monotonic() - started:.2f} s after it ended, slot 1 still generating")
    assert generation.is_alive(), "the generation ended before the test could use it: raise LONG_GENERATION"
    assert _status_slot(side, 1)["processing"]
    assert any(s["id"] == 1 and s["is_processing"] for s in slots(server.url))
    assert side.metric("llama_sidecar_snapshots_total", slot="1", result="ok") == 0
    assert side.metric("llama_sidecar_snapshots_total", slot="1", result="failed") == 0
