"""Router mode: two models behind one llama-server, one loaded at a time; each keeps its KV across swaps.

The router (``--models-dir``, ``--models-max 1``) runs one child server per
loaded model; loading one model unloads the other, and with it that model's
KV. The sidecar (``--router``) saves each model's slots under that model's
name and, when the router loads the model again, restores them. Without the
proxy, the model is loaded with ``POST /models/load`` and its first request
waits for the sidecar's restore: a request that itself makes the router load
the model would reach the new child server as soon as it is up, before any
restore. Through the proxy (``--proxy-listen``), the request itself is
enough: the proxy saves the running model's changed slots, has the router
load the requested one, and holds the request until its KV is restored.
"""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sidecar.snapshots.manifest import model_tag
from tests.support.llamabed import (
    LlamaHTTPError,
    LlamaServer,
    MakeServer,
    call,
    complete,
    http_json,
    make_prompt,
    model_states,
    models_dir,
)
from tests.support.net import free_port
from tests.support.sidecarbed import MakeSidecar, SidecarProcess

PROMPT_TOKENS = 1024
MODELS = ("alpha", "beta")
ROUTER = {"LLAMA_SIDECAR_ROUTER": "1"}


def _router(llama: MakeServer, model: Path, root: Path, slot_dir: Path) -> LlamaServer:
    return llama(slot_dir=slot_dir, ctx_size=4096, models_dir=models_dir(root / "models", model, MODELS), models_max=1)


def _saved(slot_dir: Path, name: str) -> list[str]:
    """The committed snapshots (manifests) of model `name` in the slot dir."""
    return sorted(p.name for p in slot_dir.glob(f"{model_tag(name)}--slot*.json"))


def _restored(side: SidecarProcess, name: str) -> list[dict[str, Any]]:
    """The sidecar's last successful restores of model `name`'s files."""
    tag = model_tag(name) + "--"
    last: list[dict[str, Any]] = side.status()["last_restore"]
    restored = ("ok", "unverified")  # unverified: a sliding-window model's, until its next request decides
    return [r for r in last if r["result"] in restored and (r["file"] or "").startswith(tag)]


def _converse(server: LlamaServer, side: SidecarProcess, slot_dir: Path, name: str, seed: int) -> tuple[str, int]:
    """A long prompt on model `name` (the router loads it), answered, then saved; returns (prompt, prefilled)."""
    prompt = make_prompt(server.url, PROMPT_TOKENS, seed=seed, model=name)
    cold = complete(server.url, prompt, model=name)
    prefilled = int(cold["timings"]["prompt_n"])
    assert prefilled >= PROMPT_TOKENS * 0.95
    side.wait_for(lambda: _saved(slot_dir, name), what=f"a snapshot of model {name}")
    return prompt, prefilled


def _load_and_wait_restored(server: LlamaServer, side: SidecarProcess, name: str) -> None:
    def load() -> bool:
        try:
            call("POST", server.url + "/models/load", {"model": name})
        except LlamaHTTPError as exc:
            # The router evicts only a model with no call in flight (a client's or the sidecar's
            # polls): until then it answers 500 "model limit reached, try again later".
            if exc.status == 500 and "limit reached" in str(exc.body):
                return False
            raise
        return True

    side.wait_for(load, timeout=60, what=f"the router to accept loading model {name}")
    side.wait_for(lambda: _restored(side, name), timeout=120, what=f"a restore of model {name}")


def test_swap_to_another_model_and_back_keeps_the_first_models_kv(
    llama: MakeServer,
    sidecar: MakeSidecar,
    model: Path,
    tmp_path: Path,
    slot_dir: Path,
    figure: Callable[[str], None],
) -> None:
    server = _router(llama, model, tmp_path, slot_dir)
    side = sidecar(server, slot_dir, env=ROUTER)
    prompt_a, prefilled_a = _converse(server, side, slot_dir, "alpha", seed=41)
    _converse(server, side, slot_dir, "beta", seed=42)
    assert model_states(server.url) == {"alpha": "unloaded", "beta": "loaded"}
    assert not _restored(side, "alpha")

    _load_and_wait_restored(server, side, "alpha")
    warm = complete(server.url, prompt_a + " and a few words more", model="alpha")
    figure(
        f"router mode, alpha -> beta -> alpha: {warm['timings']['cache_n']} of {prefilled_a} prompt tokens "
        f"of alpha reused after the swap; prompt_ms {warm['timings']['prompt_ms']:.0f}"
    )
    assert warm["timings"]["cache_n"] >= 0.9 * prefilled_a
    assert model_states(server.url)["beta"] == "unloaded"
    assert _saved(slot_dir, "beta"), "beta's snapshot stays on disk while beta is unloaded"
    side.wait_for(  # counted once the warm request showed the server reused it (a sliding-window model)
        lambda: side.metric("llama_sidecar_model_restores_total", model="alpha", result="ok") == 1,
        what="alpha's restore counted ok",
    )
    assert side.metric("llama_sidecar_model_restores_total", model="beta") == 0
    assert side.metric("llama_sidecar_model_snapshots_total", model="beta", result="ok") >= 1
    side.wait_for(lambda: side.metric("llama_sidecar_model_up", model="beta") == 0, what="beta seen unloaded")
    assert side.metric("llama_sidecar_model_up", model="alpha") == 1
    assert side.metric("llama_sidecar_server_up") == 1


def test_kill9_of_the_router_keeps_each_models_kv(
    llama: MakeServer,
    sidecar: MakeSidecar,
    model: Path,
    tmp_path: Path,
    slot_dir: Path,
    figure: Callable[[str], None],
) -> None:
    server = _router(llama, model, tmp_path, slot_dir)
    side = sidecar(server, slot_dir, env=ROUTER)
    prompt_a, prefilled_a = _converse(server, side, slot_dir, "alpha", seed=51)
    _converse(server, side, slot_dir, "beta", seed=52)

    router_pid = server.pid
    server.restart(graceful=False)  # kill -9 of the router; its child servers exit with it
    assert server.pid != router_pid
    assert set(model_states(server.url).values()) == {"unloaded"}

    _load_and_wait_restored(server, side, "alpha")
    warm = complete(server.url, prompt_a + " and then some more", model="alpha")
    figure(
        f"router mode, kill -9 of the router, then alpha loaded: {warm['timings']['cache_n']} of {prefilled_a} "
        f"prompt tokens reused; prompt_ms {warm['timings']['prompt_ms']:.0f}"
    )
    assert warm["timings"]["cache_n"] >= 0.9 * prefilled_a


def _proxy_up(url: str) -> bool:
    try:
        return http_json("GET", url + "/health", timeout=2)[0] == 200
    except OSError:
        return False


def test_through_the_proxy_a_swap_saves_first_and_the_way_back_waits_for_the_restore(
    llama: MakeServer,
    sidecar: MakeSidecar,
    model: Path,
    tmp_path: Path,
    slot_dir: Path,
    figure: Callable[[str], None],
) -> None:
    server = _router(llama, model, tmp_path, slot_dir)
    port, agent = free_port(), free_port()
    # Idle slots are not saved for ten minutes: alpha's KV is on disk only if it is saved before the swap.
    extra = {
        "--proxy-listen": f"127.0.0.1:{port}",
        "--idle-seconds": "600",
        "--agent-check-listen": f"127.0.0.1:{agent}",
    }
    side = sidecar(server, slot_dir, env=ROUTER, extra=extra)
    proxy = f"http://127.0.0.1:{port}"
    side.wait_for(lambda: _proxy_up(proxy), timeout=20, what="the proxy to answer /health")

    prompt_a = make_prompt(server.url, PROMPT_TOKENS, seed=61, model="alpha")
    cold = complete(proxy, prompt_a, model="alpha")
    prefilled_a = int(cold["timings"]["prompt_n"])
    assert prefilled_a >= PROMPT_TOKENS * 0.95
    assert not _saved(slot_dir, "alpha")

    complete(proxy, "A short question for the other model.", model="beta")
    assert model_states(server.url) == {"alpha": "unloaded", "beta": "loaded"}
    assert _saved(slot_dir, "alpha"), "alpha's changed slot is saved before the router unloads it"
    assert [e["loading"] for e in side.log_events("model_saving_before_swap")] == ["beta"]

    warm = complete(proxy, prompt_a + " and one more line", model="alpha")
    figure(
        f"router mode through the proxy, alpha -> beta -> alpha by requests alone: {warm['timings']['cache_n']} "
        f"of {prefilled_a} prompt tokens of alpha reused; prompt_ms {warm['timings']['prompt_ms']:.0f}"
    )
    assert warm["timings"]["cache_n"] >= 0.9 * prefilled_a
    assert _restored(side, "alpha")
    # The agent check speaks for the node: up, with the loaded model's slots (the router itself lists none).
    line = side.wait_for(lambda: _agent_line(agent), what="the agent check to count alpha's slots")
    assert line is not None
    assert line.startswith(b"ready up "), line


def _agent_line(port: int) -> bytes | None:
    """The agent check's answer, once it counts a loaded model's slots (None before)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        line = sock.makefile("rb").readline()
    return line if re.search(rb"#\d+ of [1-9]\d* slots free", line) else None


def test_a_router_is_recognised_without_the_flag_and_its_models_are_saved_and_restored(
    llama: MakeServer,
    sidecar: MakeSidecar,
    model: Path,
    tmp_path: Path,
    slot_dir: Path,
    figure: Callable[[str], None],
) -> None:
    server = _router(llama, model, tmp_path, slot_dir)
    side = sidecar(server, slot_dir)  # no --router: the sidecar learns it from the router's /props
    prompt_a, prefilled_a = _converse(server, side, slot_dir, "alpha", seed=71)
    _converse(server, side, slot_dir, "beta", seed=72)
    _load_and_wait_restored(server, side, "alpha")
    warm = complete(server.url, prompt_a + " and one line more", model="alpha")
    figure(
        f"router mode found from /props (no --router): {warm['timings']['cache_n']} of {prefilled_a} prompt "
        f"tokens of alpha reused after alpha -> beta -> alpha"
    )
    assert warm["timings"]["cache_n"] >= 0.9 * prefilled_a
    assert len(side.log_events("router_mode_detected")) == 1
    for event in ("props_unreadable", "metrics_unreadable"):  # a model's own (its child loading) may come
        assert not [e for e in side.log_events(event) if "model" not in e], f"{event} of the router itself"


def test_no_router_forces_plain_mode_and_says_so_once(
    llama: MakeServer, sidecar: MakeSidecar, model: Path, tmp_path: Path, slot_dir: Path
) -> None:
    server = _router(llama, model, tmp_path, slot_dir)
    side = sidecar(server, slot_dir, env={"LLAMA_SIDECAR_ROUTER": "0"})  # the variable of --no-router
    side.wait_for(lambda: side.log_events("server_is_router"), timeout=20, what="the sidecar to see a router")
    side.wait_for(lambda: side.metric("llama_sidecar_server_up") == 1, timeout=20, what="the router seen up")
    assert len(side.log_events("server_is_router")) == 1
    assert not side.log_events("router_mode_detected")
    assert not side.log_events("props_unreadable")  # said once, as server_is_router, not at every poll


def test_a_request_sent_right_after_a_kill9_of_the_router_waits_for_its_models_restore(
    llama: MakeServer,
    sidecar: MakeSidecar,
    model: Path,
    tmp_path: Path,
    slot_dir: Path,
    figure: Callable[[str], None],
) -> None:
    server = _router(llama, model, tmp_path, slot_dir)
    port = free_port()
    side = sidecar(server, slot_dir, env=ROUTER, extra={"--proxy-listen": f"127.0.0.1:{port}"})
    proxy = f"http://127.0.0.1:{port}"
    side.wait_for(lambda: _proxy_up(proxy), timeout=20, what="the proxy to answer /health")
    prompt_a = make_prompt(server.url, PROMPT_TOKENS, seed=81, model="alpha")
    cold = complete(proxy, prompt_a, model="alpha")
    prefilled_a = int(cold["timings"]["prompt_n"])
    side.wait_for(lambda: _saved(slot_dir, "alpha"), what="a snapshot of model alpha")

    server.kill()  # kill -9 of the router; its child servers exit with it
    server.start()  # not waited for: the request below is sent at once, through the proxy
    warm = complete(proxy, prompt_a + " and a line after the crash", model="alpha")
    figure(
        f"router mode, a request sent right after a kill -9 of the router: {warm['timings']['cache_n']} of "
        f"{prefilled_a} prompt tokens of alpha reused; prompt_ms {warm['timings']['prompt_ms']:.0f}"
    )
    assert warm["timings"]["cache_n"] >= 0.9 * prefilled_a
    assert _restored(side, "alpha")


def test_kill9_of_the_router_with_a_store_dir_restores_each_model_from_blocks(
    llama: MakeServer, sidecar: MakeSidecar, model: Path, tmp_path: Path, slot_dir: Path
) -> None:
    """``--store-dir`` in router mode: each model's saves go into the block store (manifests under
    ``STORE/snapshots`` named after the model, the slot dir only staging) and come back after a kill -9."""
    store = tmp_path / "store"
    server = _router(llama, model, tmp_path, slot_dir)
    side = sidecar(server, slot_dir, env=ROUTER, extra={"--store-dir": str(store)})
    manifests = store / "snapshots"
    prompt_a, prefilled_a = _converse(server, side, manifests, "alpha", seed=61)
    _converse(server, side, manifests, "beta", seed=62)
    assert not [p.name for p in slot_dir.iterdir() if "--slot" in p.name], "nothing of a save stays in the slot dir"
    recipes = {json.loads(p.read_text())["recipe"] for name in MODELS for p in manifests.glob(f"{model_tag(name)}--*")}
    assert len(recipes) == 2
    assert all((store / "recipes" / f"{r}.json").is_file() for r in recipes)

    server.restart(graceful=False)  # kill -9 of the router; its child servers exit with it
    _load_and_wait_restored(server, side, "alpha")
    warm = complete(server.url, prompt_a + " and then some more", model="alpha")
    assert warm["timings"]["cache_n"] >= 0.9 * prefilled_a
    # Deleted off the restore's path (a large file takes a while to free): waited for, not read at once.
    side.wait_for(lambda: not list(slot_dir.glob(".tmp-*")), what="the staged rebuild deleted after the restore")
    assert _saved(manifests, "beta"), "beta's snapshot stays in the store while beta is unloaded"
