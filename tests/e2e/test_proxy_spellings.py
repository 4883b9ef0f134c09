"""Every spelling of the slot actions, through the real proxy to a real llama-server, judged by the slots and files.

llama-server runs with ``AIP_MODE=PREDICTION`` (Vertex AI), so ``/predict``
is there too. Each request is sent raw (no client library normalises the
target) without the admin token; after each one, every slot's state
(``GET /slots`` straight to llama-server: its prompt tokens, task and text)
and every file of the slot dir (name and bytes) must be as before. A control
at the end sends one spelling with the admin token and sees it erase the
slot: the spellings do reach llama-server's slot action when let through.
"""

from __future__ import annotations

import hashlib
import json
import socket
from pathlib import Path
from typing import Any

from tests.support.llamabed import MakeServer, complete, http_json, make_prompt, slots
from tests.support.net import free_port
from tests.support.sidecarbed import MakeSidecar, manifests

ADMIN = "admin-5be0c2f9-e2e"


def _raw(port: int, method: str, target: str, body: bytes = b"", token: str | None = None) -> tuple[int, bytes]:
    head = f"{method} {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
    head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    if token is not None:
        head += f"Authorization: Bearer {token}\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(head.encode("latin-1") + b"\r\n" + body)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    answer = b"".join(chunks)
    parts = answer.split(b" ", 2)
    return (int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0), answer


def _state(url: str, slot_dir: Path) -> tuple[Any, dict[str, str]]:
    views = [{k: v.get(k) for k in ("id", "id_task", "n_prompt_tokens", "prompt", "is_processing")} for v in slots(url)]
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(slot_dir.iterdir()) if p.is_file()}
    return views, files


def _spellings(committed: str, other: str) -> list[tuple[str, str, bytes]]:
    save = json.dumps({"filename": committed}).encode()
    restore = json.dumps({"filename": other}).encode()

    def predict(fmt: str, **extra: Any) -> bytes:
        return json.dumps({"instances": [{"@requestFormat": fmt, **extra}]}).encode()

    return [
        ("POST", "/slots/0?action=erase", b""),
        ("POST", "/%u0073lots/0?action=erase", b""),
        ("POST", "/%u0073lots/1?action=save", save),
        ("POST", "/%u0073lots/0?action=restore", restore),
        ("POST", "/%73lots/0?action=erase", b""),
        ("POST", "/sl%uD800ots/0?action=erase", b""),
        ("POST", "/slots%2F0?action=erase", b""),
        ("POST", "/slots%2f1?action=save", save),
        ("POST", "/slots/0/?action=erase", b""),
        ("POST", "/slots/0;x?action=erase", b""),
        ("POST", "/slots/%30?action=erase", b""),
        ("POST", "/slots/%2530?action=erase", b""),
        ("POST", "/slots/%u0030?action=erase", b""),
        ("POST", "/slots/+0?action=erase", b""),
        ("POST", "/slots/%200?action=erase", b""),
        ("POST", "/slots/0x?action=erase", b""),
        ("POST", "/slots/0%00?action=erase", b""),
        ("POST", "/slots/0?%61ction=erase", b""),
        ("POST", "/slots/0#x?action=erase", b""),
        ("POST", "//slots/0?action=erase", b""),
        ("POST", "/v1/../slots/0?action=erase", b""),
        ("POST", "/./slots/0?action=erase", b""),
        ("POST", "/v1/%2e%2e/slots/0?action=erase", b""),
        ("POST", "/slots%5c0?action=erase", b""),
        ("POST", "/SLOTS/0?action=erase", b""),
        ("POST", "/slots?id_slot=0&action=erase", b""),
        ("PUT", "/slots/0?action=erase", b""),
        ("post", "/slots/0?action=erase", b""),
        ("POST", "http://127.0.0.1/slots/0?action=erase", b""),
        ("POST", "/predict?id_slot=0&action=erase", predict("/slots/:id_slot")),
        ("POST", "/predict?id_slot=1&action=save", predict("slots", filename=committed)),
        ("POST", "/%70redict?id_slot=0&action=restore", predict("/slots/:id_slot", filename=other)),
        ("POST", "/%u0070redict?id_slot=0&action=erase", predict("slots")),
        (
            "POST",
            "/predict?id_slot=0&action=erase",
            b'{"instances": [{"@requestFormat": "tokenize", "@requestFormat": "/slots/:id_slot"}]}',
        ),
        ("POST", "/predict?id_slot=0&action=erase", b'{"instances": [{"\\u0040requestFormat": "slots"}]}'),
    ]


def test_no_spelling_of_a_slot_action_changes_a_slot_or_a_file_without_the_admin_token(
    llama: MakeServer, sidecar: MakeSidecar, tmp_path: Path
) -> None:
    slot_dir = tmp_path / "slots"
    slot_dir.mkdir()
    server = llama(slot_dir, n_slots=2, env={"AIP_MODE": "PREDICTION"})
    port = free_port()
    side = sidecar(server, slot_dir, extra={"--proxy-listen": f"127.0.0.1:{port}", "--admin-token": ADMIN})
    proxy = f"http://127.0.0.1:{port}"
    side.wait_for(lambda: http_json("GET", proxy + "/health", timeout=2)[0] == 200, what="the proxy up")
    for slot in (0, 1):
        complete(proxy, make_prompt(server.url, 300, seed=slot), n_predict=4, id_slot=slot)
        side.wait_saved(1, slot=slot)
    side.wait_for(lambda: len(manifests(slot_dir)) == 2, what="both slots committed")
    committed = sorted(m.removesuffix(".json") + ".bin" for m in manifests(slot_dir))
    before = _state(server.url, slot_dir)
    assert all(v["n_prompt_tokens"] > 200 for v in before[0]), before[0]

    changed = []
    statuses = {}
    for method, target, body in _spellings(committed[1], committed[0]):
        status, answer = _raw(port, method, target, body)
        statuses[f"{method} {target}"] = status
        if not 400 <= status < 500:
            changed.append(f"{method} {target}: answered {status}: {answer[-300:]!r}")
        if (now := _state(server.url, slot_dir)) != before:
            changed.append(f"{method} {target}: changed the slots or files ({status})")
            before = now
    assert len(statuses) >= 22
    assert not changed, "\n".join(changed)

    # the path next to it: /predict's own formats still go through, without a token
    status, answer = _raw(
        port, "POST", "/predict", json.dumps({"instances": [{"@requestFormat": "tokenize", "content": "hi"}]}).encode()
    )
    assert status == 200, answer[-300:]
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["predictions"][0]["tokens"]

    # control: with the admin token the %u spelling reaches llama-server's slot action
    status, answer = _raw(port, "POST", "/%u0073lots/0?action=erase", token=ADMIN)
    assert status == 200, answer[-300:]
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["n_erased"] > 200
    assert slots(server.url)[0]["n_prompt_tokens"] == 0
