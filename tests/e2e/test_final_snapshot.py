"""The final snapshots at SIGTERM against the real server: a sleeping server is left asleep."""

from __future__ import annotations

from pathlib import Path

from sidecar.engine import saves
from tests.support.llamabed import MakeServer, complete, http_json, make_prompt
from tests.support.sidecarbed import MakeSidecar


def _sleeping(url: str) -> bool:
    return bool(http_json("GET", url + "/props")[1].get("is_sleeping"))


def test_sigterm_leaves_a_sleeping_server_asleep_and_saves_nothing(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    server = llama(slot_dir=slot_dir, ctx_size=4096, extra_args=["--sleep-idle-seconds", "3"])
    # A turn the sidecar has not saved yet (not idle long enough) when the server falls asleep.
    side = sidecar(server, slot_dir, extra={"--idle-seconds": "600"})
    complete(server.url, make_prompt(server.url, 300, seed=71))
    side.wait_for(lambda: side.log_events("server_sleeping"), timeout=60, what="the server falling asleep")
    assert side.terminate() == 0
    skipped = side.log_events("final_snapshot_skipped")
    print(f"final snapshot: {skipped}")
    assert [e["reason"] for e in skipped] == [saves.ASLEEP]
    assert _sleeping(server.url)
    assert side.log_events("snapshot_committed") == []
    assert [p.name for p in slot_dir.iterdir() if not p.name.startswith(".llama-kv-sidecar")] == []
