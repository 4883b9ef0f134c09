"""The slot dir: one sidecar per directory, and a directory that goes away and comes back."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from tests.support.llamabed import MakeServer, complete, make_prompt
from tests.support.sidecarbed import MakeSidecar, SidecarProcess

TOKENS = 512


def _saved(side: SidecarProcess, slot: int, n: int = 1) -> None:
    side.wait_for(
        lambda: side.metric("llama_sidecar_snapshots_total", slot=str(slot), result="ok") >= n,
        what=f"{n} snapshot(s) of slot {slot}",
    )


def test_a_second_sidecar_on_the_same_dir_exits_naming_the_first_which_keeps_working(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path, tmp_path: Path
) -> None:
    server = llama(slot_dir=slot_dir)
    first = sidecar(server, slot_dir)
    assert first.proc is not None
    complete(server.url, make_prompt(server.url, TOKENS, seed=71))
    _saved(first, 0)
    in_flight = slot_dir / ".tmp-slot0-0123456789ab.bin"  # as if the first were mid-save
    in_flight.write_bytes(b"being written")

    second = SidecarProcess(server.url, slot_dir, tmp_path / "second.log")
    started = time.monotonic()
    assert second.run_to_exit(30) == 2
    refused_in = time.monotonic() - started
    said = second.log_path.read_text()
    assert "another llama-kv-sidecar holds the slot dir" in said
    assert f"pid {first.proc.pid} on host {socket.gethostname()}" in said
    assert in_flight.exists()  # its start-up clean-up never ran
    assert second.get("/healthz")[0] == 0  # it never listened

    holder = json.loads((slot_dir / ".llama-kv-sidecar.lock").read_text())
    assert holder["pid"] == first.proc.pid
    complete(server.url, make_prompt(server.url, TOKENS * 2, seed=72))
    _saved(first, 0, n=2)
    assert first.get("/readyz")[0] == 200
    print(f"second sidecar: exit 2 after {refused_in:.2f} s naming pid {first.proc.pid}; the first saved again")


def test_slot_dir_removed_under_a_running_sidecar_then_a_new_one_mounted(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path, tmp_path: Path
) -> None:
    server = llama(slot_dir=slot_dir, n_slots=2, ctx_size=4096)
    side = sidecar(server, slot_dir)
    assert side.proc is not None
    complete(server.url, make_prompt(server.url, TOKENS, seed=73), id_slot=0)
    _saved(side, 0)
    assert side.get("/readyz")[0] == 200

    slot_dir.rename(tmp_path / "moved-away")
    started = time.monotonic()
    side.wait_for(lambda: side.get("/readyz")[0] == 503, what="/readyz 503")
    not_ready_in = time.monotonic() - started
    code, body = side.get("/readyz")
    assert code == 503
    assert any("does not exist" in p and str(slot_dir) in p for p in json.loads(body)["problems"]), body
    # A turn ends while the directory is gone: its save fails, the process keeps running.
    complete(server.url, make_prompt(server.url, TOKENS, seed=74), id_slot=0)
    side.wait_for(
        lambda: side.metric("llama_sidecar_snapshots_total", slot="0", result="failed") >= 1, what="a failed save"
    )
    assert side.proc.poll() is None
    assert side.get("/healthz")[0] == 200
    assert side.get("/status")[0] == 200
    assert side.metric("llama_sidecar_slot_dir_errors_total", operation="scan") >= 1
    side.wait_for(lambda: side.log_events("slot_dir_lost"), what="the lost dir's line")
    assert len(side.log_events("slot_dir_lost")) == 1

    slot_dir.mkdir()  # a new, empty directory at the same path: a volume mounted again
    started = time.monotonic()
    side.wait_for(lambda: side.get("/readyz")[0] == 200, what="/readyz 200 again")
    ready_in = time.monotonic() - started
    assert json.loads((slot_dir / ".llama-kv-sidecar.lock").read_text())["pid"] == side.proc.pid
    complete(server.url, make_prompt(server.url, TOKENS, seed=75), id_slot=1)
    _saved(side, 1)
    assert [p.name.split("-")[0] for p in slot_dir.glob("slot*.json")] == ["slot1"]
    side.wait_for(lambda: side.log_events("slot_dir_back"), what="the dir's return line")
    assert os.path.exists(tmp_path / "moved-away")  # nothing of the old directory was touched
    assert len(list((tmp_path / "moved-away").glob("slot0-*.json"))) == 1
    print(f"slot dir gone: /readyz 503 after {not_ready_in:.2f} s, 200 again {ready_in:.2f} s after a new one")
