"""Two nodes with --store-dir sharing one S3 bucket (a real SeaweedFS): blocks move, not whole files.

A second conversation sharing the first one's system prompt uploads only the
blocks the bucket lacks, and a node that already fetched the first fetches
only the blocks it lacks; both conversations continue warm on the other node.

The test model (Gemma 3 270M) keeps 15 of its 18 layers in a 512-token
sliding window, whose cells are the conversation's last 512 positions: new
in every conversation. So about half of the second file is new here (the
8B-class-KV figures are in ``python -m bench.shared_store --blocks``); what
is checked is that the upload sends no more than what the node's own block
store found new, plus the recipe.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support.llamabed import MakeServer, chat, make_prompt
from tests.support.net import free_port
from tests.support.s3bed import S3Server
from tests.support.sidecarbed import MakeSidecar, SidecarProcess

SYSTEM_TOKENS = 2048
USER_TOKENS = 400


def _published(node: SidecarProcess) -> list[dict[str, Any]]:
    return node.log_events("shared_snapshot_published")


def _block_bytes(node: SidecarProcess, direction: str, outcome: str) -> float:
    return node.metric("llama_sidecar_shared_store_block_bytes_total", direction=direction, outcome=outcome)


def _uploads_settled(node: SidecarProcess, at_least: int) -> None:
    node.wait_for(
        lambda: len(_published(node)) >= at_least and node.metric("llama_sidecar_shared_store_pending_uploads") == 0,
        timeout=120,
        what=f"{at_least} snapshot(s) published and no upload waiting",
    )


def test_blocks_move_between_two_store_dir_nodes_and_a_shared_prompt_is_sent_once(
    llama: MakeServer,
    sidecar: MakeSidecar,
    s3_server: S3Server,
    s3_url: str,
    tmp_path: Path,
    figure: Callable[[str], None],
) -> None:
    env = s3_server.env()
    dir_a, dir_b = tmp_path / "a", tmp_path / "b"
    for path in (dir_a, dir_b):
        path.mkdir()
    server_a = llama(slot_dir=dir_a, n_slots=2, ctx_size=8192)  # nodes sharing snapshots share a slot count
    proxy_a = f"http://127.0.0.1:{free_port()}"
    extra_a = {"--shared-store": s3_url, "--proxy-listen": proxy_a[7:], "--store-dir": str(tmp_path / "store-a")}
    node_a = sidecar(server_a, dir_a, extra=extra_a, env=env)
    system = {"role": "system", "content": make_prompt(server_a.url, SYSTEM_TOKENS, seed=61)}
    chats = [[system, {"role": "user", "content": make_prompt(server_a.url, USER_TOKENS, seed=s)}] for s in (62, 63)]

    first = chat(proxy_a, chats[0])
    _uploads_settled(node_a, 1)
    before_second = len(_published(node_a))
    assert _block_bytes(node_a, "up", "transferred") >= _published(node_a)[0]["bytes"]  # the first: every block
    local_dedup = node_a.metric("llama_sidecar_store_deduplicated_bytes_total")
    local_written = node_a.metric("llama_sidecar_store_written_bytes_total", kind="blocks")
    second = chat(proxy_a, chats[1])
    node_a.wait_for(lambda: len(_published(node_a)) > before_second, timeout=120, what="the second chat's upload")
    _uploads_settled(node_a, before_second + 1)
    later = _published(node_a)[before_second:]
    ratios = [e["transferred"] / e["bytes"] for e in later]
    sent = ", ".join(
        f"{e['transferred']:,} of {e['bytes']:,} bytes ({r:.1%})" for e, r in zip(later, ratios, strict=True)
    )
    figure(
        f"a second chat sharing a {first['usage']['prompt_tokens']}-token chat's {SYSTEM_TOKENS}-token system "
        f"prompt, uploaded as blocks: {sent}; node A's own block store found "
        f"{node_a.metric('llama_sidecar_store_deduplicated_bytes_total') - local_dedup:,.0f} bytes of it"
    )
    assert all(e["form"] == "blocks" for e in later)
    new_locally = node_a.metric("llama_sidecar_store_written_bytes_total", kind="blocks") - local_written
    # the blocks new to this node (and so to the bucket) and each snapshot's recipe and manifest, no more
    recipes = sum((tmp_path / "store-a" / "recipes" / f"{Path(e['file']).stem}.json").stat().st_size for e in later)
    assert sum(e["transferred"] for e in later) <= new_locally + recipes + 16 * 1024 * len(later), (
        new_locally,
        recipes,
        later,
    )
    assert max(ratios) < 0.6, later

    # Node B starts with nothing: its restore round fetches the newest shared snapshots into its two empty
    # slots, the second chat's first (every block), then the first chat's (only the blocks it lacks).
    server_b = llama(slot_dir=dir_b, n_slots=2, ctx_size=8192)
    proxy_b = f"http://127.0.0.1:{free_port()}"
    extra_b = {"--shared-store": s3_url, "--proxy-listen": proxy_b[7:], "--store-dir": str(tmp_path / "store-b")}
    node_b = sidecar(server_b, dir_b, extra=extra_b, env=env)
    for slot in (0, 1):
        node_b.wait_restored(slot=slot)
    fetched = node_b.log_events("shared_snapshot_fetched")
    assert [e["form"] for e in fetched] == ["blocks", "blocks"]
    turns = []
    for messages, answer in zip(chats, (first, second), strict=True):
        messages += [
            {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
            {"role": "user", "content": "And what does the record say next?"},
        ]
        turns.append(chat(proxy_b, messages))
    figure(
        "node B's restore round fetched "
        + ", ".join(f"{e['transferred']:,} of {e['bytes']:,} bytes" for e in fetched)
        + "; the chats' next turns on node B: "
        + "; ".join(f"cache_n {t['timings']['cache_n']} of {t['usage']['prompt_tokens']}" for t in turns)
    )
    assert fetched[0]["transferred"] > 0.9 * fetched[0]["bytes"]  # nothing was there: every distinct block
    assert fetched[1]["transferred"] < 0.6 * fetched[1]["bytes"]  # the shared prompt's blocks were there already
    assert _block_bytes(node_b, "down", "skipped") > 0.4 * fetched[1]["bytes"]
    for turn in turns:  # both continue warm on the node that never served them
        assert turn["timings"]["cache_n"] >= 0.9 * turn["usage"]["prompt_tokens"]
