"""Sliding-window models at llama-server's defaults (no ``--swa-full``) on every path a request takes.

Beside ``test_sliding_window`` (beside the server, the proxy with Chat
Completions): each API through the proxy (Chat Completions streamed,
Anthropic Messages streamed and not, Responses, ``/completion``), router
mode and the shared store. Each is a conversation, a ``kill -9`` of
llama-server (or, for the shared store, the conversation continuing on a
second node), and a next turn that reuses at least 99% of the previous
prompt, as the API's own answer reports it. One bed per mode, kept across
the cases that share it: Gemma 3 (the bed's model, a window of 512 in 5 of
every 6 layers) and the tiny random-weight gpt-oss (a window of 128 in every
other layer).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sidecar.shared import catalog
from sidecar.snapshots.manifest import model_tag
from tests.support import agents, tinymodels
from tests.support.llamabed import LlamaServer, MakeServer, http_json, make_prompt, models_dir
from tests.support.net import free_port
from tests.support.s3bed import S3Server
from tests.support.sidecarbed import MakeSidecar, SidecarProcess

PROMPT_TOKENS = 700
"""Above every model's window (a slot within it is not saved: nothing of it could be reused)."""
REUSED = 0.99
"""Share of the previous prompt the turn after a kill -9 must reuse."""
MARGIN = 3
N_PREDICT = 4
"""Tokens before the prompt's end a windowed slot is saved at (``sidecar.save.boundary``)."""


@dataclasses.dataclass
class Bed:
    """One llama-server (no ``--swa-full``) and a sidecar with its proxy, kept across a module's cases."""

    kind: str
    server: LlamaServer
    side: SidecarProcess
    proxy: str


def _bed(kind: str, binary: Path, model: Path, windowed: dict[tinymodels.Windowed, Path], root: Path) -> Iterator[Bed]:
    served = model if kind == tinymodels.DENSE else windowed[tinymodels.Windowed(kind)]
    slot_dir = root / "slots"
    slot_dir.mkdir()
    server = LlamaServer(binary, served, slot_dir=slot_dir, ctx_size=4096, swa_full=False, log_dir=root)
    side: SidecarProcess | None = None
    try:
        server.start()
        server.wait_healthy()
        port = free_port()
        side = SidecarProcess(
            server.url, slot_dir, root / "sidecar.log", extra={"--proxy-listen": f"127.0.0.1:{port}"}
        ).start()
        side.wait_for(lambda: side is not None and side.get("/readyz")[0] == 200, timeout=30, what="the proxy ready")
        side.wait_for(lambda: side is not None and side.status()["server"]["memory"] == "swa", what="memory kind")
        yield Bed(kind, server, side, f"http://127.0.0.1:{port}")
    finally:
        if side is not None:
            side.kill()
        server.kill()


@pytest.fixture(scope="module")
def gemma3_bed(
    llama_binary: Path,
    model: Path,
    windowed_models: dict[tinymodels.Windowed, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Bed]:
    yield from _bed(tinymodels.DENSE, llama_binary, model, windowed_models, tmp_path_factory.mktemp("swa-gemma3"))


@pytest.fixture(scope="module")
def gpt_oss_bed(
    llama_binary: Path,
    model: Path,
    windowed_models: dict[tinymodels.Windowed, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Bed]:
    kind = tinymodels.Windowed.GPT_OSS.value
    yield from _bed(kind, llama_binary, model, windowed_models, tmp_path_factory.mktemp("swa-gpt-oss"))


BEDS = ["gemma3_bed", "gpt_oss_bed"]


def _committed_within(side: SidecarProcess, low: int, high: int, after: int) -> bool:
    """Whether a snapshot of ``low`` to ``high`` tokens was committed after the first ``after`` log lines."""
    return any(
        e.get("event") == "snapshot_committed" and low <= int(e.get("tokens", 0)) <= high for e in side.logs()[after:]
    )


def _api(name: str, url: str) -> agents.Api:
    if name == "chat-streamed":
        return agents.Chat(url, stream=True)
    if name.startswith("messages"):
        return agents.Messages(url, stream=name.endswith("streamed"))
    return agents.Responses(url)


APIS = ["chat-streamed", "messages", "messages-streamed", "responses-streamed"]


def _turn_after_a_kill9(bed: Bed, name: str) -> None:
    api = _api(name, bed.proxy)
    chat = agents.Conversation.start(APIS.index(name), make_prompt(bed.server.url, PROMPT_TOKENS, seed=800 + len(name)))
    mark = len(bed.side.logs())
    first = api.send(chat)
    assert first.complete, first
    chat.answered(first, f"Read record {chat.n}.")
    bed.side.wait_for(
        lambda: _committed_within(bed.side, first.prompt - MARGIN, first.prompt - MARGIN, mark),
        what="the first turn saved at its prompt's boundary",
    )
    reply = agents.sent_across_a_kill9(bed.side, bed.server, api, chat)
    print(f"{bed.kind}, {api.name}: after kill -9, {reply.cached} of the previous prompt's {first.prompt} reused")
    assert reply.prompt > first.prompt, (reply, first)  # the answer counts the whole conversation sent
    assert reply.cached >= REUSED * first.prompt, (reply.cached, first.prompt, reply.header)
    assert reply.cached <= reply.prompt


@pytest.mark.parametrize("name", ["messages-streamed", "responses-streamed"])
def test_gemma3_each_api_through_the_proxy_the_turn_after_a_kill9_reuses_the_previous_prompt(
    gemma3_bed: Bed, name: str
) -> None:
    """The two agents' streamed APIs (Claude Code's, Codex's) on the real model with its own chat template; every
    API and mode on the tiny gpt-oss below, Chat Completions not streamed in ``test_sliding_window``."""
    _turn_after_a_kill9(gemma3_bed, name)


@pytest.mark.parametrize("name", APIS)
def test_gpt_oss_each_api_through_the_proxy_the_turn_after_a_kill9_reuses_the_previous_prompt(
    gpt_oss_bed: Bed, name: str
) -> None:
    _turn_after_a_kill9(gpt_oss_bed, name)


@pytest.mark.parametrize("bed_name", BEDS)
def test_completion_through_the_proxy_the_turn_after_a_kill9_reuses_the_previous_prompt(
    request: pytest.FixtureRequest, bed_name: str
) -> None:
    """A ``/completion`` has no chat template's generation prompt to find its boundary by: the slot is saved as it
    is, reply included, and serves a next prompt that extends the text the server wrote."""
    bed: Bed = request.getfixturevalue(bed_name)
    text = make_prompt(bed.server.url, PROMPT_TOKENS, seed=890)
    mark = len(bed.side.logs())
    body = {"prompt": text, "n_predict": N_PREDICT, "temperature": 0}
    status, first = http_json("POST", bed.proxy + "/completion", body, timeout=300)
    assert status == 200, first
    earlier = int(first["timings"]["prompt_n"]) + int(first["timings"]["cache_n"])
    bed.side.wait_for(  # a /completion has no chat template's generation prompt: saved as it is, reply included
        lambda: _committed_within(bed.side, earlier - MARGIN, earlier + N_PREDICT, mark), what="the first turn saved"
    )
    bed.server.kill()
    bed.side.wait_for(lambda: bed.side.get("/readyz")[0] == 503, what="the gate closed for the kill")
    bed.server.start()
    body["prompt"] = text + first["content"] + "\nQ: and what comes next?\nA:"
    status, answer = http_json("POST", bed.proxy + "/completion", body, timeout=300)
    assert status == 200, answer
    reused = int(answer["timings"]["cache_n"])
    print(f"{bed.kind}, /completion: after kill -9, {reused} of the previous prompt's {earlier} reused")
    assert reused >= REUSED * earlier, (reused, earlier)


def _chat_turn(url: str, messages: list[dict[str, str]], model: str) -> dict[str, Any]:
    body = {"model": model, "messages": messages, "max_tokens": N_PREDICT, "temperature": 0}
    status, answer = http_json("POST", url + "/v1/chat/completions", body, timeout=300)
    assert status == 200, answer
    result: dict[str, Any] = answer
    return result


def _saved_tokens(folder: Path, pattern: str) -> set[int]:
    found = set()
    for path in folder.glob(pattern):
        try:
            found.add(int(json.loads(path.read_text())["tokens"]))
        except (FileNotFoundError, json.JSONDecodeError):
            continue
    return found


def test_router_mode_through_the_proxy_the_turn_after_a_kill9_of_the_router_reuses_the_previous_prompt(
    llama: MakeServer, sidecar: MakeSidecar, model: Path, tmp_path: Path, slot_dir: Path
) -> None:
    """Two models behind a router (both Gemma 3, no ``--swa-full``): the running one's conversation comes back."""
    models = models_dir(tmp_path / "models", model, ("alpha", "beta"))
    server = llama(slot_dir=slot_dir, ctx_size=4096, models_dir=models, models_max=1, swa_full=False)
    port = free_port()
    side = sidecar(server, slot_dir, env={"LLAMA_SIDECAR_ROUTER": "1"}, extra={"--proxy-listen": f"127.0.0.1:{port}"})
    proxy = f"http://127.0.0.1:{port}"
    side.wait_for(lambda: side.get("/readyz")[0] == 200, timeout=30, what="the proxy ready")
    messages = [{"role": "user", "content": make_prompt(server.url, PROMPT_TOKENS, seed=870, model="alpha")}]
    first = _chat_turn(proxy, messages, "alpha")
    earlier = int(first["usage"]["prompt_tokens"])
    side.wait_for(
        lambda: earlier - MARGIN in _saved_tokens(slot_dir, f"{model_tag('alpha')}--slot*.json"),
        what="alpha's conversation saved at its prompt's boundary",
    )
    server.kill()  # kill -9 of the router; its child servers exit with it
    server.start()  # not waited for: the next turn is sent at once, through the proxy
    messages += [
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And what does the record say next?"},
    ]
    turn = _chat_turn(proxy, messages, "alpha")
    reused = int(turn["timings"]["cache_n"])
    print(f"router mode, alpha after a kill -9 of the router: {reused} of the previous prompt's {earlier} reused")
    assert turn["usage"]["prompt_tokens"] > earlier
    assert reused >= REUSED * earlier, (reused, earlier)


SHARED_TOKENS = 1000
"""Past the window; node A records its prefill rate in the snapshot, so node B fetches rather than prefills it."""


def test_shared_store_a_conversation_saved_on_node_a_continues_on_node_b_reusing_the_previous_prompt(
    llama: MakeServer, sidecar: MakeSidecar, s3_server: S3Server, s3_url: str, tmp_path: Path
) -> None:
    """Two nodes (each a llama-server with Gemma 3, no ``--swa-full``, and a sidecar with its proxy) share one
    bucket: node A's snapshot, saved at its prompt's boundary with the cell below the window, serves the
    conversation's next turn on node B."""
    env = s3_server.env()
    nodes = []
    for name in ("a", "b"):
        slots = tmp_path / name
        slots.mkdir()
        server = llama(slot_dir=slots, ctx_size=4096, swa_full=False)
        listen = f"127.0.0.1:{free_port()}"
        nodes.append(
            (
                server,
                sidecar(server, slots, extra={"--shared-store": s3_url, "--proxy-listen": listen}, env=env),
                f"http://{listen}",
            )
        )
    (server_a, node_a, proxy_a), (_, node_b, proxy_b) = nodes
    node_b.wait_for(lambda: node_b.get("/readyz")[0] == 200, timeout=30, what="node B ready")
    messages = [
        {"role": "system", "content": agents.SYSTEM},
        {"role": "user", "content": make_prompt(server_a.url, SHARED_TOKENS, seed=880)},
    ]
    first = _chat_turn(proxy_a, messages, "m")
    earlier = int(first["usage"]["prompt_tokens"])
    node_a.wait_for(
        lambda: earlier - MARGIN in _saved_tokens(tmp_path / "a", "slot*.json"),
        what="node A's conversation saved at its prompt's boundary",
    )
    node_a.wait_for(
        lambda: node_a.metric("llama_sidecar_shared_store_objects_total", direction="up") == 1,
        what="the upload of node A's snapshot",
    )
    made_before = time.monotonic()  # node B's listings made before the upload show nothing of it: let them expire
    node_b.wait_for(
        lambda: time.monotonic() - made_before >= catalog.REFRESH_EVERY,
        timeout=catalog.REFRESH_EVERY + 5.0,
        what="node B's earlier listings of the store to expire",
    )
    messages += [
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And what does the record say next?"},
    ]
    turn = _chat_turn(proxy_b, messages, "m")
    reused = int(turn["timings"]["cache_n"])
    found = (node_b.log_events("shared_prefix_found") or [{}])[-1]
    print(f"shared store, node B: {reused} of the previous prompt's {earlier} reused ({found.get('verdict')})")
    assert turn["usage"]["prompt_tokens"] > earlier
    assert node_b.metric("llama_sidecar_shared_store_objects_total", direction="down") == 1
    assert reused >= REUSED * earlier, (reused, earlier, found)
