"""The proxy in front of a llama-server with API keys: keys are checked first, and keys' conversations kept apart.

One llama-server with two slots and ``--cache-ram 0`` (its RAM prompt cache is
one for every client: the sidecar can keep owners apart only below it), its
keys in one key file shared with the sidecar: two keys of a pool, then two
keys of their own. A client with no key, or a wrong one, is refused before
the library does anything; a key never reuses, swaps in or learns of another
key's conversation, while keys of one pool share theirs.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.support.llamabed import LlamaServer, MakeServer, make_prompt, slots
from tests.support.net import free_port
from tests.support.sidecarbed import MakeSidecar, SidecarProcess, manifest_records

TEAM_ONE = "sk-team-one-5d8e1f0a93c2"
TEAM_TWO = "sk-team-two-71b4c6e2d0f8"
ALICE = "sk-alice-0c9f3e8a1b7d"
BOB = "sk-bob-e42a7c19f3b6"
CAROL = "sk-carol-9a0d5b3e7c21"
KEYS = (TEAM_ONE, TEAM_TWO, ALICE, BOB, CAROL)
KEY_FILE = f"# pool: team\n{TEAM_ONE}\n{TEAM_TWO}\n# pool:\n{ALICE}\n{BOB}\n{CAROL}\n"
PROMPT_TOKENS = 600
WARM = 0.9
SECRET = "The vault PIN is 4821."


def _post(url: str, body: Any, headers: dict[str, str]) -> tuple[int, dict[str, str], Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    for name, value in headers.items():
        req.add_header(name, value)
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            status, got, raw = int(resp.status), dict(resp.headers.items()), resp.read()
    except urllib.error.HTTPError as err:
        status, got, raw = int(err.code), dict(err.headers.items()), err.read()
    return status, got, json.loads(raw)


class Chat:
    def __init__(self, system: str, text: str) -> None:
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}, {"role": "user", "content": text}]
        self.prompt_tokens = 0

    def body(self) -> dict[str, Any]:
        return {"messages": self.messages, "max_tokens": 2, "temperature": 0}

    def turn(self, proxy: str, key: str) -> tuple[int, int, str]:
        """Send the conversation with ``key``; (cache_n, the earlier turn's prompt tokens, the prefix header)."""
        status, headers, answer = _post(proxy + "/v1/chat/completions", self.body(), {"Authorization": f"Bearer {key}"})
        assert status == 200, answer
        earlier, self.prompt_tokens = self.prompt_tokens, answer["usage"]["prompt_tokens"]
        self.messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
        self.messages.append({"role": "user", "content": "And the next line?"})
        return int(answer["timings"]["cache_n"]), earlier, headers.get("X-Llama-Sidecar-Prefix", "")


def _start(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path, tmp_path: Path
) -> tuple[LlamaServer, SidecarProcess, str]:
    key_file = tmp_path / "api-keys"
    key_file.write_text(KEY_FILE)
    server = llama(
        slot_dir=slot_dir, n_slots=2, ctx_size=4096, extra_args=["--api-key-file", str(key_file), "--cache-ram", "0"]
    )
    port = free_port()
    side = sidecar(
        server,
        slot_dir,
        env={"LLAMA_API_KEY_FILE": str(key_file)},
        extra={"--proxy-listen": f"127.0.0.1:{port}", "--server-cache-ram-bytes": "0"},
    )
    side.wait_for(lambda: side.get("/readyz")[0] == 200, timeout=30, what="the sidecar ready")
    return server, side, f"http://127.0.0.1:{port}"


def _library_figures(side: SidecarProcess) -> dict[str, float]:
    """What the library did: requests by source, swaps, saves."""
    figures = {
        source: side.metric("llama_sidecar_conversation_requests_total", source=source)
        for source in ("slot", "library", "shared", "cold")
    }
    figures["swaps"] = side.metric("llama_sidecar_swap_duration_seconds_count")
    figures["snapshots"] = sum(side.metric("llama_sidecar_snapshots_total", slot=s, result="ok") for s in ("0", "1"))
    return figures


def _slot_state(server: LlamaServer) -> list[tuple[int, Any, Any]]:
    return [(s["id"], s.get("id_task"), s.get("n_prompt_tokens")) for s in slots(server.url, api_key=ALICE)]


def _files(slot_dir: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in slot_dir.iterdir() if p.suffix in (".bin", ".json")}


def test_a_request_without_a_key_the_server_accepts_touches_no_slot_no_snapshot_and_says_nothing(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path, tmp_path: Path
) -> None:
    server, side, proxy = _start(llama, sidecar, slot_dir, tmp_path)
    chat = Chat("You answer in one short sentence.", make_prompt(server.url, PROMPT_TOKENS, seed=611, api_key=ALICE))
    chat.turn(proxy, ALICE)
    cache_n, earlier, _ = chat.turn(proxy, ALICE)
    assert cache_n >= WARM * earlier
    side.wait_for(lambda: _library_figures(side)["snapshots"] >= 1, timeout=60, what="alice's conversation saved")
    side.wait_for(lambda: not any(s["is_processing"] for s in slots(server.url, api_key=ALICE)), what="idle slots")
    before = (_slot_state(server), _files(slot_dir), _library_figures(side))

    refused = [
        {},
        {"Authorization": "Bearer sk-not-a-key"},
        {"X-Api-Key": "sk-not-a-key"},
        {"Authorization": f"Basic {ALICE}"},  # llama-server strips only 'Bearer '
        {"Authorization": f"bearer {ALICE}"},  # nor any other case of it
        {"Authorization": "Bearer ", "X-Api-Key": "sk-not-a-key"},
    ]
    for headers in refused:
        status, got, answer = _post(proxy + "/v1/chat/completions", chat.body(), headers)
        assert status == 401, (headers, answer)
        assert answer["error"]["type"] == "authentication_error"
        assert "X-Llama-Sidecar-Prefix" not in got, headers
    status, _, answer = _post(proxy + "/v1/completions", {"prompt": chat.messages[1]["content"], "max_tokens": 1}, {})
    assert status == 401, answer

    assert (_slot_state(server), _files(slot_dir), _library_figures(side)) == before
    assert side.metric("llama_sidecar_proxy_requests_total", route="completion", outcome="refused") == len(refused) + 1
    # The key llama-server reads from X-Api-Key when Authorization is empty passes too.
    status, got, answer = _post(proxy + "/v1/chat/completions", chat.body(), {"X-Api-Key": ALICE})
    assert status == 200, answer
    assert "source=slot" in got["X-Llama-Sidecar-Prefix"]
    log = side.log_path.read_text()
    assert not [key for key in KEYS if key in log]


def test_one_key_never_reuses_nor_swaps_in_another_keys_conversation_and_a_pool_shares_its_own(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path, tmp_path: Path
) -> None:
    server, side, proxy = _start(llama, sidecar, slot_dir, tmp_path)
    text = make_prompt(server.url, PROMPT_TOKENS, seed=612, api_key=ALICE)
    alice = Chat(f"You answer in one short sentence. {SECRET}", text)
    alice.turn(proxy, ALICE)
    cache_n, earlier, _ = alice.turn(proxy, ALICE)
    assert cache_n >= WARM * earlier

    # Bob sends alice's conversation as it stood, word for word (a guess that is right): it reuses nothing.
    guess = Chat(f"You answer in one short sentence. {SECRET}", text)
    guess.messages = [dict(m) for m in alice.messages[:-2]]
    cache_n, _, header = guess.turn(proxy, BOB)
    print(f"bob's right guess: cache_n {cache_n}, {header}")
    assert cache_n == 0, f"bob reused {cache_n} tokens of alice's conversation ({header})"
    assert "source=cold" in header
    cache_n, earlier, header = guess.turn(proxy, BOB)  # bob's own conversation now: his next turn is warm
    assert cache_n >= WARM * earlier, header
    cache_n, earlier, _ = alice.turn(proxy, ALICE)  # and alice's is still hers
    assert cache_n >= WARM * earlier

    # The team's two keys share one pool: the second continues the first's conversation warm.
    team = Chat("You answer in one short sentence.", make_prompt(server.url, PROMPT_TOKENS, seed=613, api_key=ALICE))
    team.turn(proxy, TEAM_ONE)
    cache_n, earlier, header = team.turn(proxy, TEAM_TWO)
    print(f"team-two after team-one: cache_n {cache_n}/{earlier}, {header}")
    assert cache_n >= WARM * earlier, header

    # Alice's conversation is in the library only now (two slots, three owners' conversations): carol's right
    # guess is not swapped in for her.
    records = manifest_records(slot_dir)
    assert records
    assert all(r.get("owner") for r in records)
    assert not [key for key in KEYS for r in records if key in json.dumps(r)]
    swaps = side.metric("llama_sidecar_swap_duration_seconds_count")
    carol = Chat(alice.messages[0]["content"], text)
    carol.messages = [dict(m) for m in alice.messages[:-2]]
    cache_n, _, header = carol.turn(proxy, CAROL)
    assert cache_n == 0, header
    assert "source=cold" in header
    assert side.metric("llama_sidecar_swap_duration_seconds_count") == swaps
    cache_n, earlier, header = alice.turn(proxy, ALICE)  # alice comes back from the library, swapped in
    assert cache_n >= WARM * earlier, header
    assert "source=library" in header or "source=slot" in header
    log = side.log_path.read_text()
    assert not [key for key in KEYS if key in log]
    assert SECRET not in log


def _messages_turn(proxy: str, key: str, system: str, messages: list[dict[str, str]]) -> tuple[int, int, str]:
    """One Anthropic Messages turn; (cache_read_input_tokens, all its prompt tokens, the answer's text)."""
    body = {"model": "any", "max_tokens": 2, "temperature": 0, "system": system, "messages": messages}
    status, _, answer = _post(proxy + "/v1/messages", body, {"x-api-key": key})
    assert status == 200, answer
    usage = answer["usage"]
    cached = int(usage.get("cache_read_input_tokens", 0))
    return cached, cached + int(usage["input_tokens"]), answer["content"][0]["text"]


def test_on_anthropic_messages_where_the_server_picks_the_slot_another_keys_conversation_is_not_reused(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path, tmp_path: Path
) -> None:
    """llama-server's Anthropic converter drops ``id_slot`` and ``cache_prompt``: the server gives the request
    the idle slot with the longest common prefix, so the proxy empties other owners' slots first (saved)."""
    server, side, proxy = _start(llama, sidecar, slot_dir, tmp_path)
    system = f"You answer in one short sentence. {SECRET}"
    messages = [{"role": "user", "content": make_prompt(server.url, PROMPT_TOKENS, seed=614, api_key=ALICE)}]
    _, prompt, text = _messages_turn(proxy, ALICE, system, messages)
    followed = [*messages, {"role": "assistant", "content": text}, {"role": "user", "content": "And the next?"}]
    cached, _, _ = _messages_turn(proxy, ALICE, system, followed)
    assert cached >= WARM * prompt

    cached, _, _ = _messages_turn(proxy, BOB, system, messages)  # bob's right guess, as alice sent it
    print(f"bob's right guess on /v1/messages: {cached} tokens reused")
    assert cached == 0
    assert side.log_events("slot_not_cleared") == []
    cached, _, _ = _messages_turn(proxy, ALICE, system, followed)  # alice's conversation was kept, in the library
    assert cached >= WARM * prompt
    log = side.log_path.read_text()
    assert not [key for key in KEYS if key in log]
