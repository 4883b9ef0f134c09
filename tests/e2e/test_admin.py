"""POST /snapshot and /restore against the real llama-server: good calls, bad ones, a failed save."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from tests.support.llamabed import MakeServer, complete, make_prompt
from tests.support.sidecarbed import MakeSidecar, SidecarProcess, bin_of, manifests

TOKENS = 1024
ADMIN = "admin-token-for-the-e2e-tests"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
MANUAL_ONLY = {"--admin-token": ADMIN, "--idle-seconds": "600", "--snapshot-interval": "600"}


def _post(side: SidecarProcess, path: str, auth: dict[str, str] | None = None) -> tuple[int, Any]:
    code, body = side.request("POST", path, headers=AUTH if auth is None else auth)
    return code, json.loads(body)


def _holds(side: SidecarProcess, tokens: int) -> bool:
    slots = side.status()["slots"]
    return bool(slots) and slots[0]["tokens"] >= tokens


def test_admin_snapshot_refuses_bad_callers_and_slots_then_saves_and_restores(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path, tmp_path: Path
) -> None:
    server = llama(slot_dir=slot_dir)
    side = sidecar(server, slot_dir, extra=MANUAL_ONLY)
    prompt = make_prompt(server.url, TOKENS, seed=101)
    complete(server.url, prompt)
    side.wait_for(lambda: _holds(side, TOKENS), what="the sidecar to see the finished turn")

    assert _post(side, "/snapshot?slot=0", auth={})[0] == 401
    assert _post(side, "/snapshot?slot=0", auth={"Authorization": "Bearer wrong"})[0] == 401
    for bad in ("1", "7", "-1", "x", ""):  # slots this one-slot server does not have, or no number
        code, reply = _post(side, f"/snapshot?slot={bad}")
        assert code == 400, (bad, reply)
        assert "slot" in str(reply["error"])
    assert manifests(slot_dir) == []

    code, reply = _post(side, "/snapshot?slot=0")
    assert code == 200, reply
    assert reply["ok"] is True
    (saved,) = manifests(slot_dir)
    (committed,) = side.log_events("snapshot_committed")
    assert committed["reason"] == "manual"
    assert committed["file"] == bin_of(saved)
    side.kill()

    # /restore: a restarted server, and a sidecar that found no snapshot when it started (so it
    # restored nothing by itself); the snapshot comes back into the dir, the admin asks.
    aside = tmp_path / "aside"
    aside.mkdir()
    for name in (bin_of(saved), saved):
        shutil.move(slot_dir / name, aside / name)
    server.restart(graceful=False)
    side = sidecar(server, slot_dir, extra=MANUAL_ONLY)
    side.wait_for(lambda: side.status()["server"]["health"] == "ok", what="the server seen up")
    for name in (bin_of(saved), saved):  # file first, manifest last, as a save does
        shutil.move(aside / name, slot_dir / name)
    side.wait_for(lambda: side.status()["snapshots"].get("0"), what="the snapshot indexed")
    assert side.metric("llama_sidecar_restores_total", slot="0", result="ok") == 0
    code, reply = _post(side, "/restore")
    assert code == 200, reply
    # a sliding-window model (Gemma 3): unverified until the slot's next request shows it reused
    assert [(r["slot"], r["result"]) for r in reply["results"]] == [(0, "unverified")]
    warm = complete(server.url, prompt + " and after the restore")
    assert warm["timings"]["cache_n"] >= 0.95 * TOKENS
    side.wait_for(
        lambda: side.metric("llama_sidecar_restores_total", slot="0", result="ok") == 1, what="the restore counted ok"
    )
    # The slot now holds a request's tokens: a second /restore leaves it alone.
    code, reply = _post(side, "/restore")
    assert code == 200, reply
    assert [(r["slot"], r["result"]) for r in reply["results"]] == [(0, "slot_busy")]


def test_admin_snapshot_that_fails_answers_500_with_the_reason(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path, tmp_path: Path
) -> None:
    server = llama(slot_dir=slot_dir)
    elsewhere = tmp_path / "not-the-servers"
    elsewhere.mkdir()
    side = sidecar(server, elsewhere, extra=MANUAL_ONLY)
    complete(server.url, make_prompt(server.url, TOKENS, seed=102))
    side.wait_for(lambda: _holds(side, TOKENS), what="the sidecar to see the finished turn")
    code, reply = _post(side, "/snapshot?slot=0")
    assert code == 500, reply
    assert reply["ok"] is False
    result = reply["result"]
    assert result["result"] == "failed"
    assert "--slot-dir" in result["detail"]
    assert side.metric("llama_sidecar_snapshots_total", slot="0", result="failed") == 1
    assert manifests(elsewhere) == []
    assert side.get("/healthz")[0] == 200
