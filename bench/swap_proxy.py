"""Swap speed through the proxy: two conversations take turns on one slot, each return a swap that saves first.

Part of section 18 (:mod:`bench.swap`). llama-server runs with one slot and
``--cache-ram 0``, the sidecar with its proxy, ``--idle-seconds 600`` (no
idle save comes between two turns: each swap saves the slot's own content
first, as when an agent's tool loop returns before the idle save) and
``--server-cache-ram-bytes 0``. Two conversations of the 8B-class-KV model
take turns of a few words; each turn brings its conversation back from the
library: the sidecar saves the leaving one, then restores the returning one
(from the block store: rebuilt, while the save runs). Figure: the
``seconds`` of each ``conversation_swapped_in`` log line that saved first,
whole files and block store on fresh servers one after the other, the slot
dir on the same staging filesystem either way.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

from bench import rig
from bench.beds import llamabed, net, widekv


@dataclasses.dataclass(frozen=True, slots=True)
class Way:
    name: str
    seconds: list[float]
    """Each swap that saved the slot first: its save, rebuild and restore, as the sidecar logged it."""
    cached: list[int]
    """``cache_n`` of each turn: how much of the conversation the swap brought back."""


def one_way(bed: rig.Rig, *, blocks: bool, tokens: int, turns: int, staging_root: Path, say: rig.Say) -> Way:
    name = "block store" if blocks else "whole files"
    tag = "blocks" if blocks else "whole"
    slot_dir = staging_root / f"llama-kv-bench-swap-proxy-{os.getpid()}-{tag}"
    shutil.rmtree(slot_dir, ignore_errors=True)
    slot_dir.mkdir(parents=True)
    try:
        model = widekv.model(tokenizer_from=bed.model)
        server = bed.server(
            slot_dir=slot_dir,
            n_slots=1,
            ctx_size=2 * tokens + 1024,
            model=model,
            swa_full=False,
            extra_args=["--cache-ram", "0"],
        )
        options = {
            "--proxy-listen": f"127.0.0.1:{net.free_port()}",
            "--idle-seconds": "600",
            "--server-cache-ram-bytes": "0",
        }
        if blocks:
            options["--store-dir"] = str(bed.slot_dir(f"swap-proxy-store-{tag}"))
        side = bed.sidecar(server, slot_dir, **options)
        side.wait_for(lambda: side.get("/readyz")[0] == 200, timeout=120, what="the sidecar ready")
        proxy = "http://" + options["--proxy-listen"]
        prompts = [llamabed.make_prompt(server.url, tokens, seed=5150 + i) for i in range(2)]
        say(f"swap through the proxy ({name}): two conversations of {tokens:,} tokens")
        for prompt in prompts:
            llamabed.complete(proxy, prompt, n_predict=1)
        cached = []
        for turn in range(turns):
            back = turn % 2
            prompts[back] += f" Then, turn {turn}, one more word."
            cached.append(int(llamabed.complete(proxy, prompts[back], n_predict=1)["timings"]["cache_n"]))
        swaps = [e for e in side.log_events("conversation_swapped_in") if e.get("saved_first")]
        side.kill()
        server.kill()
        return Way(name, [float(e["seconds"]) for e in swaps], cached)
    finally:
        shutil.rmtree(slot_dir, ignore_errors=True)


def run(bed: rig.Rig, *, tokens: int, turns: int, staging_root: Path, say: rig.Say) -> list[Way]:
    return [
        one_way(bed, blocks=blocks, tokens=tokens, turns=turns, staging_root=staging_root, say=say)
        for blocks in (False, True)
    ]
