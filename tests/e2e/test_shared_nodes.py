"""Two nodes sharing one S3 bucket (a real SeaweedFS): a snapshot made on one comes back warm on the other.

At start-up (the restore round fetches into empty slots) and on the request
path (the proxy fetches the conversation a request continues).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from sidecar.core import location
from sidecar.shared import catalog, connect
from tests.support import weights
from tests.support.llamabed import MakeServer, chat, complete, http_json, make_prompt
from tests.support.net import free_port
from tests.support.s3bed import S3Server
from tests.support.sidecarbed import MakeSidecar, SidecarProcess, manifests

PROMPT_TOKENS = 1024
CHAT_TOKENS = 3072
"""Long enough that fetching its snapshot clearly beats prefilling it, even on a fast machine."""


def _bucket_keys(url: str) -> list[str]:
    async def listed() -> list[str]:
        objects = connect.open_store(location.parse(url, os.environ))
        try:
            return [i.key for i in await objects.list_objects(location.parse(url, os.environ).key_prefix + "/")]
        finally:
            await objects.close()

    return asyncio.run(listed())


def _slot_dirs(tmp_path: Path) -> tuple[Path, Path]:
    """One slot dir for each node: nothing local is shared."""
    dirs = tmp_path / "a", tmp_path / "b"
    for path in dirs:
        path.mkdir()
    return dirs


def test_a_snapshot_of_node_a_comes_back_warm_on_node_b(
    llama: MakeServer,
    sidecar: MakeSidecar,
    s3_server: S3Server,
    s3_url: str,
    tmp_path: Path,
    figure: Callable[[str], None],
) -> None:
    env = s3_server.env()
    dir_a, dir_b = _slot_dirs(tmp_path)
    server_a = llama(slot_dir=dir_a)
    node_a = sidecar(server_a, dir_a, extra={"--shared-store": s3_url}, env=env)
    prompt = make_prompt(server_a.url, PROMPT_TOKENS, seed=41)
    cold = complete(server_a.url, prompt)
    node_a.wait_saved()
    node_a.wait_for(
        lambda: node_a.metric("llama_sidecar_shared_store_objects_total", direction="up") == 1,
        what="the upload of node A's snapshot",
    )
    keys = _bucket_keys(s3_url)
    assert [k.split("/")[-2] for k in keys] == ["blobs", "manifests"], keys
    uploaded = node_a.metric("llama_sidecar_shared_store_bytes_total", direction="up")
    assert uploaded == (dir_a / manifests(dir_a)[0].removesuffix(".json")).with_suffix(".bin").stat().st_size

    server_b = llama(slot_dir=dir_b)  # another server, another slot dir: nothing local
    node_b = sidecar(server_b, dir_b, extra={"--shared-store": s3_url}, env=env)
    node_b.wait_restored()
    assert node_b.metric("llama_sidecar_shared_store_objects_total", direction="down") == 1
    assert len(manifests(dir_b)) == 1
    warm = complete(server_b.url, prompt + " and the next turn")
    n_prompt = cold["timings"]["prompt_n"]
    figure(
        f"node B after fetching node A's snapshot from S3: cache_n {warm['timings']['cache_n']} of {n_prompt};"
        f" prompt_ms cold on A {cold['timings']['prompt_ms']:.0f}, on B {warm['timings']['prompt_ms']:.0f}"
    )
    assert warm["timings"]["cache_n"] >= 0.9 * n_prompt


def test_store_outage_never_stops_local_snapshots_and_uploads_catch_up(
    llama: MakeServer, sidecar: MakeSidecar, s3_server: S3Server, s3_url: str, slot_dir: Path
) -> None:
    server = llama(slot_dir=slot_dir)
    side = sidecar(server, slot_dir, extra={"--shared-store": s3_url}, env=s3_server.env())
    s3_server.stop()
    prompt = make_prompt(server.url, PROMPT_TOKENS, seed=42)
    complete(server.url, prompt)
    side.wait_saved()  # the local commit does not wait for the store
    assert len(manifests(slot_dir)) == 1
    side.wait_for(
        lambda: side.metric("llama_sidecar_shared_store_errors_total") >= 1, what="a counted shared store error"
    )
    assert side.metric("llama_sidecar_shared_store_pending_uploads") == 1
    warm = complete(server.url, prompt + " more")  # serving goes on
    assert warm["timings"]["cache_n"] >= 0.9 * PROMPT_TOKENS

    s3_server.start()
    side.wait_for(
        lambda: (
            side.metric("llama_sidecar_shared_store_pending_uploads") == 0
            and side.metric("llama_sidecar_shared_store_objects_total", direction="up") >= 1
        ),
        timeout=120,
        what="the upload once the store is back",
    )
    assert any(k.endswith(".json") and "/manifests/" in k for k in _bucket_keys(s3_url))


def _wait_uploaded(node: SidecarProcess) -> None:
    node.wait_for(
        lambda: node.metric("llama_sidecar_shared_store_objects_total", direction="up") == 1,
        what="the upload of the node's snapshot",
    )


def _wait_listings_stale(node: SidecarProcess) -> None:
    """Wait until every listing of the store ``node`` made before now is older than ``catalog.REFRESH_EVERY``.

    A node reuses its listing that long (only its own uploads make it list again), so one made before
    another node's upload shows nothing of it: the node's next lookup then lists the store afresh.
    """
    made_before = time.monotonic()
    node.wait_for(
        lambda: time.monotonic() - made_before >= catalog.REFRESH_EVERY,
        timeout=catalog.REFRESH_EVERY + 5.0,
        what="the node's earlier listings of the store to expire",
    )


def test_a_chat_saved_on_node_a_continues_warm_through_node_b_proxy(
    llama: MakeServer,
    sidecar: MakeSidecar,
    s3_server: S3Server,
    s3_url: str,
    tmp_path: Path,
    figure: Callable[[str], None],
) -> None:
    env = s3_server.env()
    dir_a, dir_b = _slot_dirs(tmp_path)
    server_a, server_b = llama(slot_dir=dir_a), llama(slot_dir=dir_b)
    proxy_a, proxy_b = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    node_a = sidecar(server_a, dir_a, extra={"--shared-store": s3_url, "--proxy-listen": proxy_a}, env=env)
    node_b = sidecar(server_b, dir_b, extra={"--shared-store": s3_url, "--proxy-listen": proxy_b}, env=env)
    # node B serves a conversation of its own first: it measures its prefill rate and, uploading it, its bandwidth
    other = [{"role": "user", "content": make_prompt(server_b.url, PROMPT_TOKENS, seed=51)}]
    chat(f"http://{proxy_b}", other)
    node_b.wait_saved()

    messages = [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": make_prompt(server_a.url, CHAT_TOKENS, seed=52)},
    ]
    first = chat(f"http://{proxy_a}", messages)
    node_a.wait_saved()
    for node in (node_a, node_b):
        _wait_uploaded(node)
    assert node_b.metric("llama_sidecar_shared_store_objects_total", direction="down") == 0  # nothing at its start

    messages += [
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And what does the record say next?"},
    ]
    turn = chat(f"http://{proxy_b}", messages)
    timings, prompt_tokens = turn["timings"], turn["usage"]["prompt_tokens"]
    found = (node_b.log_events("shared_prefix_found") or [{}])[-1]
    figure(
        f"next turn of a {first['usage']['prompt_tokens']}-token chat from node A through node B's proxy:"
        f" cache_n {timings['cache_n']} of {prompt_tokens}; prompt_ms on A {first['timings']['prompt_ms']:.0f},"
        f" on B {timings['prompt_ms']:.0f}; B estimated fetch {found.get('fetch_seconds')} s against prefill"
        f" {found.get('prefill_seconds')} s at {found.get('prefill_rate')} tokens/s ({found.get('verdict')})"
    )
    assert node_b.metric("llama_sidecar_conversation_requests_total", source="shared") == 1
    assert node_b.metric("llama_sidecar_shared_store_objects_total", direction="down") == 1
    assert timings["cache_n"] >= 0.9 * prompt_tokens


MID_TOKENS = 1400
"""A mid-size conversation: its prefill at the old default rate (5,000 tokens/s) looked cheaper than a fetch."""


def test_a_node_that_just_started_fetches_a_mid_size_chat_at_the_rate_its_snapshot_records(
    llama: MakeServer,
    sidecar: MakeSidecar,
    s3_server: S3Server,
    s3_url: str,
    tmp_path: Path,
    figure: Callable[[str], None],
) -> None:
    env = s3_server.env()
    dir_a, dir_b = _slot_dirs(tmp_path)
    server_a, server_b = llama(slot_dir=dir_a), llama(slot_dir=dir_b)
    proxy_a, proxy_b = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    node_a = sidecar(server_a, dir_a, extra={"--shared-store": s3_url, "--proxy-listen": proxy_a}, env=env)
    # Node B starts before node A's snapshot exists (its restore round finds nothing) and serves nothing
    # of its own: its counters say nothing about its prefill rate, as after any start or restart.
    node_b = sidecar(server_b, dir_b, extra={"--shared-store": s3_url, "--proxy-listen": proxy_b}, env=env)
    messages = [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": make_prompt(server_a.url, MID_TOKENS, seed=53)},
    ]
    first = chat(f"http://{proxy_a}", messages)
    node_a.wait_saved()
    _wait_uploaded(node_a)
    _wait_listings_stale(node_b)  # its restore round listed the store, maybe before node A's upload
    recorded = json.loads((dir_a / manifests(dir_a)[0]).read_text())["prefill_rate"]
    assert recorded > 0, "node A records its measured prefill rate in the snapshot's manifest"

    messages += [
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And what does the record say next?"},
    ]
    turn = chat(f"http://{proxy_b}", messages)
    timings, prompt_tokens = turn["timings"], turn["usage"]["prompt_tokens"]
    found = (node_b.log_events("shared_prefix_found") or [{}])[-1]
    figure(
        f"a node just started, next turn of a {first['usage']['prompt_tokens']}-token chat of node A:"
        f" cache_n {timings['cache_n']} of {prompt_tokens}; prompt_ms on A {first['timings']['prompt_ms']:.0f},"
        f" on B {timings['prompt_ms']:.0f}; B estimated fetch {found.get('fetch_seconds')} s against prefill"
        f" {found.get('prefill_seconds')} s at {found.get('prefill_rate')} tokens/s from the"
        f" {found.get('prefill_rate_from')} ({found.get('verdict')})"
    )
    assert found.get("verdict") == "fetch", found
    assert found.get("prefill_rate_from") == "snapshot"
    assert node_b.metric("llama_sidecar_conversation_requests_total", source="shared") == 1
    assert timings["cache_n"] >= 0.9 * prompt_tokens


def _namespaces(url: str) -> set[str]:
    prefix = location.parse(url, os.environ).key_prefix
    return {k.removeprefix(prefix + "/").split("/")[0] for k in _bucket_keys(url)}


def _copy_namespace(url: str, source: str, target: str) -> int:
    """Copy every object of namespace ``source`` under ``target``, as a writer of the bucket could."""

    async def copy() -> int:
        where = location.parse(url, os.environ)
        objects = connect.open_store(where)
        try:
            infos = await objects.list_objects(f"{where.key_prefix}/{source}/")
            for info in infos:
                data = b"".join([chunk async for chunk in objects.stream(info.key)])
                await objects.put_bytes(info.key.replace(f"/{source}/", f"/{target}/", 1), data)
            return len(infos)
        finally:
            await objects.close()

    return asyncio.run(copy())


def test_a_snapshot_of_other_weights_under_this_nodes_prefix_is_refused_and_the_request_runs_cold(
    llama: MakeServer,
    sidecar: MakeSidecar,
    s3_server: S3Server,
    s3_url: str,
    model: Path,
    tmp_path: Path,
    figure: Callable[[str], None],
) -> None:
    """The key prefix is not a proof: a fetched snapshot must fit the running model before the server sees it."""
    env = s3_server.env()
    dir_x, dir_b = _slot_dirs(tmp_path)
    server_x = llama(slot_dir=dir_x, start=False)  # the same shapes, other weights: a fine-tune
    server_x.model = weights.other_weights(model, tmp_path / "fine-tune.gguf")
    server_x.start()
    server_x.wait_healthy()
    server_b = llama(slot_dir=dir_b)
    proxy_x, proxy_b = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    node_x = sidecar(server_x, dir_x, extra={"--shared-store": s3_url, "--proxy-listen": proxy_x}, env=env)
    node_b = sidecar(server_b, dir_b, extra={"--shared-store": s3_url, "--proxy-listen": proxy_b}, env=env)
    # node B serves a conversation of its own first: its prefill rate, its bandwidth, its namespace in the bucket
    chat(f"http://{proxy_b}", [{"role": "user", "content": make_prompt(server_b.url, PROMPT_TOKENS, seed=53)}])
    node_b.wait_saved()
    _wait_uploaded(node_b)
    (ours,) = _namespaces(s3_url)

    messages = [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": make_prompt(server_x.url, CHAT_TOKENS, seed=54)},
    ]
    first = chat(f"http://{proxy_x}", messages)
    node_x.wait_saved()
    _wait_uploaded(node_x)
    (theirs,) = _namespaces(s3_url) - {ours}
    assert _copy_namespace(s3_url, theirs, ours) == 2  # its blob and its manifest, under node B's prefix

    messages += [
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And what does the record say next?"},
    ]
    restored_before = node_b.metric("llama_sidecar_restores_total", result="ok")
    turn = chat(f"http://{proxy_b}", messages)
    status, cold = http_json(
        "POST",
        server_b.url + "/v1/chat/completions",
        {"messages": messages, "max_tokens": 2, "temperature": 0, "cache_prompt": False},
        timeout=300,
    )
    assert status == 200, cold
    refused = node_b.log_events("shared_snapshot_refused")
    figure(
        f"a {first['usage']['prompt_tokens']}-token chat made with other weights, put under node B's prefix:"
        f" {len(refused)} refusal(s) ({refused[0]['reason'] if refused else 'none'}),"
        f" {node_b.metric('llama_sidecar_shared_store_objects_total', direction='down'):.0f} fetched;"
        f" node B's turn cache_n {turn['timings']['cache_n']} of {turn['usage']['prompt_tokens']}"
    )
    assert node_b.metric("llama_sidecar_shared_store_refused_total", reason="incompatible") == 1
    assert [e["reason"] for e in refused] == ["incompatible"]
    assert "weights: snapshot" in refused[0]["detail"]
    assert refused[0]["effect"]
    assert refused[0]["hint"]
    assert node_b.metric("llama_sidecar_shared_store_objects_total", direction="down") == 0
    assert node_b.metric("llama_sidecar_conversation_requests_total", source="shared") == 0
    assert node_b.metric("llama_sidecar_restores_total", result="ok") == restored_before
    held = {json.loads((dir_b / name).read_text())["fingerprint"]["model_path"] for name in manifests(dir_b)}
    assert held == {str(server_b.model)}  # nothing of the other weights in node B's slot dir
    assert turn["timings"]["cache_n"] < 0.5 * turn["usage"]["prompt_tokens"]  # prefilled: cold
    assert turn["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
