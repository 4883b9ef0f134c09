"""A random-weight sliding-window model with an 8B-class KV shape, written by the test bed: no download.

The windowed sibling of :mod:`tests.support.widekv`: the same attention
(32 layers x 8 KV heads x 128 dims of K and of V, 128 KiB per token in f16
were every layer global, as Llama 3.1 8B and Qwen3 8B), in a ``gemma3``
GGUF with a sliding window of :data:`WINDOW` positions in 5 of every 6
layers, as Gemma 3 4B to 27B keep it (``src/models/gemma3.cpp``: the
pattern is fixed at 6; 32 layers is the size the pinned build names 8B).
Without ``--swa-full`` its slot files hold every position of the 6 global
layers (5 of them in 32: layers 5, 11, 17, 23 and 29) and the last
:data:`WINDOW` positions of the others; what saving one costs the sidecar
beyond a plain model's save (the rewind to the prompt's boundary: a scratch
save, then the server's own rebuild from its checkpoint) follows that.
Its text is gibberish; its KV is real. Kept in the user cache dir under a
name that changes with this module's source, as :mod:`tests.support.widekv`.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from tests.support import tinymodels, widekv

WINDOW = 1024
"""Gemma 3 4B, 12B and 27B's window."""
PATTERN = 6
"""Every 6th layer is global (``load_swa_pattern(ml, 6)``)."""
GLOBAL_LAYERS = sum(1 for il in range(widekv.N_LAYER) if il % PATTERN == PATTERN - 1)
KV_BYTES_PER_TOKEN = widekv.KV_BYTES_PER_TOKEN
"""K and V of every layer, f16: 131,072 bytes (what ``--swa-full`` would keep per token)."""
GLOBAL_KV_BYTES_PER_TOKEN = GLOBAL_LAYERS * widekv.N_HEAD_KV * widekv.HEAD * 2 * 2
"""What a slot file holds per token beyond the window: the global layers' K and V."""

_lock = threading.Lock()


def model(*, tokenizer_from: Path) -> Path:
    """The path of the model, written on first use (about a minute: the vocabulary and ~230 MB)."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    version = hashlib.sha256(Path(__file__).read_bytes() + Path(widekv.__file__).read_bytes()).hexdigest()[:12]
    path = root / "llama-kv-sidecar" / f"wide-kv-swa-{version}" / "gemma3-8b-class-kv-swa.gguf"
    with _lock:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            _write(temp, tokenizer_from)
            temp.replace(path)
    return path


def _write(path: Path, tokenizer_from: Path) -> None:
    rng = np.random.default_rng(0)
    a = "gemma3"
    n_embd, n_layer, n_head, n_head_kv, head, n_ff = (
        widekv.N_EMBD, widekv.N_LAYER, widekv.N_HEAD, widekv.N_HEAD_KV, widekv.HEAD, widekv.N_FF,
    )  # fmt: skip
    writer = gguf.GGUFWriter(str(path), a)
    writer.add_uint32("general.file_type", 1)
    writer.add_string("general.name", "random gemma3 with an 8B-class KV and a sliding window")
    for key, value in (
        ("context_length", widekv.CONTEXT),
        ("embedding_length", n_embd),
        ("block_count", n_layer),
        ("feed_forward_length", n_ff),
        ("attention.head_count", n_head),
        ("attention.head_count_kv", n_head_kv),
        ("attention.key_length", head),
        ("attention.value_length", head),
        ("rope.dimension_count", head),
        ("attention.sliding_window", WINDOW),
    ):
        writer.add_uint32(f"{a}.{key}", value)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32(f"{a}.rope.freq_base", 1000000.0)
    writer.add_float32(f"{a}.rope.freq_base_swa", 10000.0)
    vocab = tinymodels._copy_tokenizer(writer, tokenizer_from)
    writer.add_string("tokenizer.chat_template", tinymodels.CHATML)
    tensors: dict[str, np.ndarray[Any, Any]] = {}

    def weight(name: str, ne0: int, ne1: int) -> None:
        tensors[name] = (rng.standard_normal((ne1, ne0), dtype=np.float32) * 0.05).astype(np.float16)

    def vector(name: str, n: int) -> None:
        tensors[name] = np.ones(n, dtype=np.float32)

    weight("token_embd.weight", n_embd, vocab)
    vector("output_norm.weight", n_embd)
    for il in range(n_layer):
        for norm in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            vector(f"blk.{il}.{norm}.weight", n_embd)
        weight(f"blk.{il}.attn_q.weight", n_embd, n_head * head)
        weight(f"blk.{il}.attn_k.weight", n_embd, n_head_kv * head)
        weight(f"blk.{il}.attn_v.weight", n_embd, n_head_kv * head)
        weight(f"blk.{il}.attn_output.weight", n_head * head, n_embd)
        vector(f"blk.{il}.attn_q_norm.weight", head)
        vector(f"blk.{il}.attn_k_norm.weight", head)
        weight(f"blk.{il}.ffn_gate.weight", n_embd, n_ff)
        weight(f"blk.{il}.ffn_up.weight", n_embd, n_ff)
        weight(f"blk.{il}.ffn_down.weight", n_ff, n_embd)
    for name, data in tensors.items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
