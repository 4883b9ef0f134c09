"""The weights, not the shape: a model file rewritten with other weights of the same size.

A fine-tune copied over the model file keeps its path, size and parameter
count; its KV cache restores without an error and answers change. The
sidecar hashes the model file, so the old snapshot is refused, naming the
field, and counted as incompatible.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import BinaryIO

import xxhash

from support.llamabed import MakeServer, complete, make_prompt
from support.sidecarbed import MakeSidecar

_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
"""GGUF value types of fixed size: their byte counts (8 is a string, 9 an array)."""


def _u32(fh: BinaryIO) -> int:
    return int(struct.unpack("<I", fh.read(4))[0])


def _u64(fh: BinaryIO) -> int:
    return int(struct.unpack("<Q", fh.read(8))[0])


def _skip_value(fh: BinaryIO, kind: int) -> None:
    if kind == 8:
        fh.seek(_u64(fh), 1)
    elif kind == 9:
        inner, count = _u32(fh), _u64(fh)
        for _ in range(count):
            _skip_value(fh, inner)
    else:
        fh.seek(_SCALARS[kind], 1)


def tensor_data_offset(path: Path) -> int:
    """Where the tensor data of a GGUF file starts (past header, metadata and tensor infos)."""
    with path.open("rb") as fh:
        assert fh.read(4) == b"GGUF"
        assert _u32(fh) >= 2
        n_tensors, n_kv = _u64(fh), _u64(fh)
        alignment = 32
        for _ in range(n_kv):
            key = fh.read(_u64(fh)).decode()
            kind = _u32(fh)
            if key == "general.alignment":
                alignment = _u32(fh)
            else:
                _skip_value(fh, kind)
        for _ in range(n_tensors):
            fh.seek(_u64(fh), 1)  # name
            fh.seek(8 * _u32(fh) + 4 + 8, 1)  # dims, type, offset
        return -(-fh.tell() // alignment) * alignment


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
    size = weights_file.stat().st_size
    start = tensor_data_offset(weights_file)
    assert start < size // 2
    with weights_file.open("r+b") as fh:  # other weights, same size, same shapes: a "fine-tune" in place
        fh.seek(start + (size - start) // 2)
        chunk = fh.read(64)
        fh.seek(-len(chunk), 1)
        fh.write(bytes(b ^ 0x01 for b in chunk))
    assert weights_file.stat().st_size == size
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
