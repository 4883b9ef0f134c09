"""The weights, not the shape: a model file rewritten with other weights of the same size.

A fine-tune copied over the model file keeps its path, size and parameter
count; its KV cache restores without an error and answers change. The
sidecar hashes the model file, so the old snapshot is refused, naming the
field, and counted as incompatible.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import xxhash

from tests.support import weights
from tests.support.llamabed import MakeServer, complete, make_prompt
from tests.support.sidecarbed import MakeSidecar


def test_other_weights_of_the_same_size_are_refused_naming_weights(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path, model: Path, tmp_path: Path
) -> None:
    weights_file = tmp_path / "model.gguf"
    shutil.copyfile(model, weights_file)
    server = llama(slot_dir=slot_dir, start=False)
    server.model = weights_file
    server.start()
    server.wait_healthy()
    side = sidecar(server, slot_dir)
    complete(server.url, make_prompt(server.url, 512, seed=61))
    side.wait_for(
        lambda: side.metric("llama_sidecar_snapshots_total", slot="0", result="ok") >= 1, what="first snapshot"
    )
    (written,) = slot_dir.glob("slot0-*.json")
    recorded = json.loads(written.read_text())["fingerprint"]["weights"]
    assert recorded == "xxh3-128:" + xxhash.xxh3_128_hexdigest(weights_file.read_bytes())
    assert json.loads(written.read_text())["fingerprint"]["adapters"] == []

    server.kill()
    weights.rewrite_weights(weights_file)  # other weights, same size, same shapes: a "fine-tune" in place
    server.start()
    server.wait_healthy()

    side.wait_for(
        lambda: side.metric("llama_sidecar_restores_total", slot="0", result="incompatible") == 1,
        what="the snapshot refused as incompatible",
    )
    (refusal,) = side.log_events("snapshot_incompatible")
    assert refusal["differences"].startswith("weights: snapshot " + recorded)
    assert "model_path" not in refusal["differences"]  # the shape fields all match: only the weights tell
    assert "model_size" not in refusal["differences"]
    assert side.metric("llama_sidecar_restores_total", slot="0", result="ok") == 0
    hashed = side.log_events("model_file_hashed")
    assert len(hashed) == 2  # once per content, not per poll
    print(
        f"other weights: 1 of 1 snapshot refused naming weights; model file {hashed[1]['bytes']} bytes "
        f"hashed in {hashed[0]['seconds']} s and {hashed[1]['seconds']} s"
    )
