"""A conversation's next turn goes to the slot that ran it with no round trip, on the real server.

Through the proxy, with the official SDKs, one conversation per API and mode
(Chat Completions streamed and not, Anthropic Messages streamed and not,
Responses streamed) and a ``/completion`` one take three turns each in a row
on 2 slots: from the second turn on, each is routed by its turn
(``library_routes_total{by="turn"}``: no ``/apply-template``, no
``/tokenize``, ``library_prompt_bytes_total`` unchanged), lands on its own
slot and reuses at least 90% of its earlier prompt. On the dense test model
and on the tiny ``qwen35`` hybrid, whose recurrent state the server cannot
cut back.

Then each API's conversation once more, after the others took both slots:
back from llama-server's RAM prompt cache, placed by the chain its copy
left with (``by="ram_turn"``, no ids asked) on the dense model, by its ids
on the hybrid.

And the case next to it: a client straight to llama-server runs a turn of
its own in the only slot, right after a conversation's turn there (after the
sidecar's last poll). The conversation's next turn must not take the slot as
still its own: it is routed by its ids, the other client's turn is saved
before the conversation's snapshot goes back in, and it comes back warm.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import agents, tinymodels
from tests.support.llamabed import MakeServer, http_json, make_prompt, slots
from tests.support.sidecarbed import MakeSidecar, SidecarProcess, manifest_records, proxied

TURNS = 3
WARM = 0.9
ROUTES = "llama_sidecar_library_routes_total"
BYTES = "llama_sidecar_library_prompt_bytes_total"


def _counts(side: SidecarProcess) -> tuple[float, float, float]:
    return (
        side.metric(ROUTES, by="turn"),
        side.metric(ROUTES, by="tokens"),
        side.metric(BYTES, source="asked") + side.metric(BYTES, source="remembered"),
    )


def _slot_of(header: str) -> str:
    return dict(part.strip().split("=", 1) for part in header.split(";"))["slot"]


def _completion(url: str, prompt: str) -> tuple[int, int]:
    """A /completion turn: (its cache_n, its prompt's tokens)."""
    status, answer = http_json(
        "POST", url + "/completion", {"prompt": prompt, "n_predict": 2, "temperature": 0}, timeout=300
    )
    assert status == 200, answer
    timings = answer["timings"]
    return int(timings["cache_n"]), int(timings["cache_n"]) + int(timings["prompt_n"])


@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", ["gemma3", "qwen35"])
def test_every_apis_next_turns_go_to_their_slot_with_no_round_trip(
    llama: MakeServer,
    sidecar: MakeSidecar,
    slot_dir: Path,
    tiny_models: dict[tinymodels.Arch, Path],
    kind: str,
) -> None:
    server = llama(slot_dir=slot_dir, n_slots=2, ctx_size=8192, **tinymodels.serving(kind, tiny_models))
    side, url = proxied(sidecar, server, slot_dir)
    figures: dict[str, list[str]] = {}
    chats: list[tuple[agents.Api, agents.Conversation]] = []
    for n, api in enumerate(agents.every_api(url)):
        chat = agents.Conversation.start(n, make_prompt(server.url, 500, seed=600 + n))
        chats.append((api, chat))
        home = ""
        for turn in range(TURNS):
            before = _counts(side)
            earlier = chat.prompt
            reply = api.send(chat)
            after = _counts(side)
            assert reply.complete, (api.name, turn)
            figures.setdefault(api.name, []).append(f"{reply.cached}/{earlier}")
            if turn == 0:
                assert after[1] == before[1] + 1, (api.name, "a new conversation is routed by its ids")
                home = _slot_of(reply.header)
                chat.answered(reply, f"Read record {n}.")
                continue
            assert after[0] == before[0] + 1, (api.name, turn, "not routed by its turn", before, after)
            assert after[1:] == before[1:], (api.name, turn, "the server was asked for the prompt's ids", after)
            assert reply.cached >= WARM * earlier, (api.name, turn, reply.cached, earlier, reply.header)
            if api.name.startswith("chat") or api.name.startswith("responses"):
                assert _slot_of(reply.header) == home, (api.name, reply.header)  # pinned to it
            chat.answered(reply, f"And what does record {n} say after turn {turn + 1}?")
    text = make_prompt(server.url, 500, seed=690)
    cached: list[int] = []
    made = 0
    for turn in range(TURNS):
        before = _counts(side)
        reused, prompt_tokens = _completion(url, text)
        after = _counts(side)
        cached.append(reused)
        if turn:
            assert after[0] == before[0] + 1, ("/completion", turn, before, after)
            assert after[1:] == before[1:], ("/completion", turn, before, after)
            assert reused >= WARM * made, ("/completion", turn, reused, made)
        made = prompt_tokens
        text += f" ok.\nQ{turn}: and then?\nA:"
    print(f"{kind}: reused/earlier prompt per turn: {figures}; /completion cache_n {cached}")

    # Each API's conversation comes back after others took both slots: llama-server's RAM prompt cache (on at
    # its defaults) holds it. On a model whose state cuts back it is placed by the chain that copy left with
    # (no /apply-template, no /tokenize); on the hybrid, whose restored state must be an exact prefix, by its ids
    # (the library's snapshot serves it).
    cuts_back = kind != "qwen35"
    for api, chat in chats:
        placed = side.metric(ROUTES, by="ram_turn"), side.metric(BYTES, source="asked")
        earlier = chat.prompt
        reply = api.send(chat)
        then = side.metric(ROUTES, by="ram_turn"), side.metric(BYTES, source="asked")
        assert reply.complete, (api.name, "back from RAM")
        print(f"{kind}: {api.name} back after others took its slot: {reply.cached}/{earlier}, {reply.header}")
        assert reply.cached >= WARM * earlier, (api.name, "came back cold", reply.cached, earlier, reply.header)
        if cuts_back:
            assert then == (placed[0] + 1, placed[1]), (api.name, "not placed by its RAM copy", placed, then)
        else:
            assert then[0] == placed[0], (api.name, "a hybrid placed by its RAM copy's chain")
            assert then[1] > placed[1], (api.name, "a hybrid placed with no ids")
    assert side.metric("llama_sidecar_conversation_unrouted_total") == 0


@pytest.mark.timeout(600)
def test_a_turn_another_client_ran_in_the_slot_is_saved_and_the_next_turn_is_routed_by_its_ids(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    server = llama(slot_dir=slot_dir, n_slots=1, ctx_size=8192, extra_args=["--cache-ram", "0"])
    side, url = proxied(sidecar, server, slot_dir, {"--server-cache-ram-bytes": "0"})
    api = agents.Chat(url, stream=True)
    chat = agents.Conversation.start(0, make_prompt(server.url, 600, seed=610))
    reply = api.send(chat)
    chat.answered(reply, "Read record 0.")
    home = int(_slot_of(reply.header))
    side.wait_saved(1, slot=home)  # the conversation is in the library: its next turn can come back warm
    before = _counts(side)
    other = make_prompt(server.url, 700, seed=611)
    status, answer = http_json(
        "POST", server.url + "/completion", {"prompt": other, "n_predict": 2, "id_slot": home}, timeout=300
    )  # straight to llama-server, into the conversation's slot, right after its turn
    assert status == 200, answer
    theirs = int(answer["timings"]["prompt_n"]) + int(answer["timings"]["cache_n"])
    earlier = chat.prompt
    reply = api.send(chat)
    after = _counts(side)
    assert after[0] == before[0], "routed by its turn onto a slot that holds another client's prompt"
    assert after[1] == before[1] + 1
    assert reply.complete
    assert reply.cached >= WARM * earlier, (reply.cached, earlier, reply.header)

    def kept() -> bool:
        for record in manifest_records(slot_dir):
            if record["slot"] == home and theirs <= int(record["tokens"]) <= theirs + 2:
                return True
        return False

    assert kept(), "the other client's turn was run over before it was saved"
    assert [int(s["id"]) for s in slots(server.url)] == [home]
