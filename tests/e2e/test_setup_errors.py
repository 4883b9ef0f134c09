"""Bad setups get a clear log line and the sidecar keeps serving."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

from tests.support.llamabed import MakeServer
from tests.support.net import free_port
from tests.support.sidecarbed import MakeSidecar
from tests.support.wait import wait_until


class _Refuser:
    """Listens on a port and closes every connection at once, counting them: a server that is not there."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_server(("127.0.0.1", port))
        self.calls = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.calls += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()
        self.thread.join(5)


def test_server_unreachable_at_start_keeps_trying_and_says_so_once(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    server = llama(slot_dir=slot_dir, start=False)
    refuser = _Refuser(server.port)
    try:
        side = sidecar(server, slot_dir)
        wait_until(lambda: refuser.calls >= 8, timeout=30, what="eight polls of a server that is not there")
    finally:
        refuser.close()
    assert len(side.log_events("server_unreachable")) == 1
    assert side.get("/healthz")[0] == 200
    code, body = side.get("/readyz")
    assert code == 503
    assert "not healthy" in body
    server.start()
    server.wait_healthy()
    side.wait_for(lambda: side.log_events("server_up"), what="server_up")
    side.wait_for(lambda: side.get("/readyz")[0] == 200, what="ready")
    assert side.metric("llama_sidecar_server_up") == 1


def test_server_without_slot_save_path_is_named(llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path) -> None:
    server = llama(slot_dir=None)
    side = sidecar(server, slot_dir)
    found = side.wait_for(lambda: side.log_events("slot_dir_not_linked"), what="missing flag reported")
    assert "--slot-save-path" in found[0]["problem"]
    code, body = side.get("/readyz")
    assert code == 503
    assert "--slot-save-path" in json.loads(body)["problems"][0]


def test_slot_dir_that_is_not_the_servers_is_detected(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path, tmp_path: Path
) -> None:
    server = llama(slot_dir=slot_dir)
    elsewhere = tmp_path / "not-the-servers"
    elsewhere.mkdir()
    side = sidecar(server, elsewhere)
    found = side.wait_for(lambda: side.log_events("slot_dir_not_linked"), what="mismatch reported")
    assert "--slot-save-path" in found[0]["problem"]
    assert str(elsewhere) in found[0]["problem"]
    assert side.get("/readyz")[0] == 503
    # One probe, of an empty slot: a single tiny file the sidecar could not see to remove.
    leftovers = list(slot_dir.iterdir())
    assert len(leftovers) == 1
    assert leftovers[0].name.startswith(".probe-")
    assert leftovers[0].stat().st_size < 100
    assert side.get("/healthz")[0] == 200


def test_missing_or_bad_slot_dir_exits_with_a_clear_error(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    for bad in (tmp_path / "missing", not_a_dir):
        proc = subprocess.run(
            [sys.executable, "-m", "sidecar", "run", "--slot-dir", str(bad), "--listen", f"127.0.0.1:{free_port()}"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert proc.returncode == 2, proc.stderr
        assert str(bad) in proc.stderr
        assert "--slot-dir" in proc.stderr
