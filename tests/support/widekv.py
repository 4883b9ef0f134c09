"""A random-weight model whose KV per token is 8B-class (128 KiB in f16), written by the test bed: no download.

Llama 3.1 8B and Qwen3 8B keep 32 layers x 8 KV heads x 128 dims of K and
of V per token; what a snapshot costs follows that, not the weights. So
this writes a ``qwen3`` GGUF with exactly that attention and little else
(``n_embd`` 256, a 512-wide FFN, f16, the tokenizer of the test model): a
233 MB file whose slot files are 128 KiB per token (recipe in the shared
MODELS.md, "A model with an 8B-class KV"). Its text is gibberish; its KV
is real. Kept in the user cache dir under a name that changes with this
module's source, as :mod:`tests.support.tinymodels` keeps its models.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from tests.support import tinymodels

N_EMBD = 256
N_LAYER = 32
N_HEAD = 8
N_HEAD_KV = 8
HEAD = 128
N_FF = 512
CONTEXT = 32768
KV_BYTES_PER_TOKEN = N_LAYER * N_HEAD_KV * HEAD * 2 * 2
"""K and V, f16: 131,072 bytes."""

_lock = threading.Lock()


def model(*, tokenizer_from: Path) -> Path:
    """The path of the model, written on first use (about a minute: the vocabulary and 233 MB)."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    version = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    path = root / "llama-kv-sidecar" / f"wide-kv-{version}" / "qwen3-8b-class-kv.gguf"
    with _lock:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            _write(temp, tokenizer_from)
            temp.replace(path)
    return path


def _write(path: Path, tokenizer_from: Path) -> None:
    rng = np.random.default_rng(0)
    a = "qwen3"
    writer = gguf.GGUFWriter(str(path), a)
    writer.add_uint32("general.file_type", 1)
    writer.add_string("general.name", "random qwen3 with an 8B-class KV")
    for key, value in (
        ("context_length", CONTEXT),
        ("embedding_length", N_EMBD),
        ("block_count", N_LAYER),
        ("feed_forward_length", N_FF),
        ("attention.head_count", N_HEAD),
        ("attention.head_count_kv", N_HEAD_KV),
        ("attention.key_length", HEAD),
        ("attention.value_length", HEAD),
        ("rope.dimension_count", HEAD),
    ):
        writer.add_uint32(f"{a}.{key}", value)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32(f"{a}.rope.freq_base", 1000000.0)
    vocab = tinymodels._copy_tokenizer(writer, tokenizer_from)
    writer.add_string("tokenizer.chat_template", tinymodels.CHATML)
    tensors: dict[str, np.ndarray[Any, Any]] = {}

    def weight(name: str, ne0: int, ne1: int) -> None:
        tensors[name] = (rng.standard_normal((ne1, ne0), dtype=np.float32) * 0.05).astype(np.float16)

    def vector(name: str, n: int) -> None:
        tensors[name] = np.ones(n, dtype=np.float32)

    weight("token_embd.weight", N_EMBD, vocab)
    vector("output_norm.weight", N_EMBD)
    for il in range(N_LAYER):
        vector(f"blk.{il}.attn_norm.weight", N_EMBD)
        vector(f"blk.{il}.ffn_norm.weight", N_EMBD)
        weight(f"blk.{il}.attn_q.weight", N_EMBD, N_HEAD * HEAD)
        weight(f"blk.{il}.attn_k.weight", N_EMBD, N_HEAD_KV * HEAD)
        weight(f"blk.{il}.attn_v.weight", N_EMBD, N_HEAD_KV * HEAD)
        weight(f"blk.{il}.attn_output.weight", N_HEAD * HEAD, N_EMBD)
        vector(f"blk.{il}.attn_q_norm.weight", HEAD)
        vector(f"blk.{il}.attn_k_norm.weight", HEAD)
        weight(f"blk.{il}.ffn_gate.weight", N_EMBD, N_FF)
        weight(f"blk.{il}.ffn_up.weight", N_EMBD, N_FF)
        weight(f"blk.{il}.ffn_down.weight", N_FF, N_EMBD)
    for name, data in tensors.items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
