"""llama-server with --api-key: a key list (rotation), a shared key file, and a key it refuses."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.llamabed import MakeServer, complete, make_prompt
from tests.support.sidecarbed import MakeSidecar, SidecarProcess

TOKENS = 512
NEW_KEY = "sk-rotated-in-7a1c"
OLD_KEY = "sk-rotating-out-2f9e"


def _saved(side: SidecarProcess) -> None:
    side.wait_for(
        lambda: side.metric("llama_sidecar_snapshots_total", slot="0", result="ok") >= 1,
        what="a snapshot of slot 0",
    )


def test_a_comma_separated_key_list_is_accepted(llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path) -> None:
    keys = f"{NEW_KEY},{OLD_KEY}"
    server = llama(slot_dir=slot_dir, api_key=keys)  # llama-server --api-key k1,k2: both keys work
    side = sidecar(server, slot_dir, env={"LLAMA_API_KEY": keys})
    # A client still on the old key; the sidecar sends the first one.
    complete(server.url, make_prompt(server.url, TOKENS, seed=71, api_key=OLD_KEY), api_key=OLD_KEY)
    _saved(side)
    side.wait_for(lambda: side.get("/readyz")[0] == 200, what="/readyz 200")
    assert side.metric("llama_sidecar_server_readable") == 1
    assert side.log_events("server_refuses_sidecar") == []
    log = side.log_path.read_text()
    assert NEW_KEY not in log
    assert OLD_KEY not in log


def test_one_key_file_for_the_server_and_the_sidecar(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path, tmp_path: Path
) -> None:
    key_file = tmp_path / "api-keys"
    key_file.write_text(f"# one key per line, as llama-server's --api-key-file reads it\n{NEW_KEY}\n{OLD_KEY}\n")
    server = llama(slot_dir=slot_dir, extra_args=["--api-key-file", str(key_file)])
    side = sidecar(server, slot_dir, env={"LLAMA_API_KEY_FILE": str(key_file)})
    complete(server.url, make_prompt(server.url, TOKENS, seed=72, api_key=NEW_KEY), api_key=NEW_KEY)
    _saved(side)
    assert side.proc is not None
    assert NEW_KEY not in Path(f"/proc/{side.proc.pid}/cmdline").read_text()


def test_a_refused_key_makes_the_sidecar_not_ready_and_says_why(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    server = llama(slot_dir=slot_dir, api_key=f"{NEW_KEY},{OLD_KEY}")
    side = sidecar(server, slot_dir, env={"LLAMA_API_KEY": "sk-revoked-0000"})
    complete(server.url, make_prompt(server.url, TOKENS, seed=73, api_key=NEW_KEY), api_key=NEW_KEY)

    def refusal() -> str:
        code, body = side.get("/readyz")
        problems = " ".join(json.loads(body)["problems"]) if code == 503 else ""
        return problems if "refuses the sidecar" in problems else ""

    problems = side.wait_for(refusal, timeout=30, what="/readyz 503 naming the refused key")
    assert "HTTP 401" in problems
    assert "Invalid API Key" in problems
    assert "LLAMA_API_KEY" in problems
    assert side.metric("llama_sidecar_server_up") == 1
    assert side.metric("llama_sidecar_server_readable") == 0
    side.wait_for(lambda: side.log_events("server_refuses_sidecar"), what="the refusal's line")
    assert len(side.log_events("server_refuses_sidecar")) == 1
    assert side.metric("llama_sidecar_snapshots_total", slot="0", result="ok") == 0
    assert not list(slot_dir.glob("slot0-*.json"))
