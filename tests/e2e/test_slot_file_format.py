"""The slot file parser against files the real llama-server wrote."""

from __future__ import annotations

from pathlib import Path

from sidecar.snapshots import slotfile
from tests.support.llamabed import MakeServer, call, complete, make_prompt, slot_action


def test_token_ids_of_a_real_slot_file_are_the_prompt_and_the_answer(llama: MakeServer, slot_dir: Path) -> None:
    server = llama(slot_dir=slot_dir)
    prompt = make_prompt(server.url, 600, seed=11)
    done = complete(server.url, prompt, n_predict=8)
    saved = slot_action(server.url, 0, "save", "probe.bin")

    got = slotfile.read_tokens(slot_dir / "probe.bin")

    assert got.count == saved["n_saved"]
    # The completion tokenizes with the model's special tokens (BOS); /tokenize must be told to.
    prompt_ids = call("POST", server.url + "/tokenize", {"content": prompt, "add_special": True})["tokens"]
    assert len(prompt_ids) == done["timings"]["prompt_n"]
    assert got.data.startswith(slotfile.pack_ids(prompt_ids))
    assert got.count > len(prompt_ids)  # the answer's tokens follow the prompt's


def test_a_longer_turn_shares_the_earlier_turns_prefix_hashes(llama: MakeServer, slot_dir: Path) -> None:
    server = llama(slot_dir=slot_dir)
    prompt = make_prompt(server.url, 700, seed=12)
    complete(server.url, prompt, n_predict=4)
    slot_action(server.url, 0, "save", "first.bin")
    complete(server.url, prompt + " and the next question of the same conversation", n_predict=4)
    slot_action(server.url, 0, "save", "second.bin")

    first = slotfile.prefix_hashes(slotfile.read_tokens(slot_dir / "first.bin").data)
    second = slotfile.prefix_hashes(slotfile.read_tokens(slot_dir / "second.bin").data)

    assert len(first) >= 700 // slotfile.BLOCK_TOKENS
    assert slotfile.shared_blocks(first, second) >= len(first) - 1
