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
from collections.abc import Callable
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
    return cached("wide-kv", "qwen3-8b-class-kv.gguf", (Path(__file__),), lambda path: _write(path, tokenizer_from))


def cached(folder: str, name: str, sources: tuple[Path, ...], write: Callable[[Path], None]) -> Path:
    """A written model in the user cache dir, under a folder named for the source of what writes it."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    version = hashlib.sha256(b"".join(source.read_bytes() for source in sources)).hexdigest()[:12]
    path = root / "llama-kv-sidecar" / f"{folder}-{version}" / name
    with _lock:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            write(temp)
            temp.replace(path)
    return path


def _write(path: Path, tokenizer_from: Path) -> None:
    write(path, tokenizer_from, arch="qwen3", name="random qwen3 with an 8B-class KV")


def write(
    path: Path,
    tokenizer_from: Path,
    *,
    arch: str,
    name: str,
    u32: tuple[tuple[str, int], ...] = (),
    f32: tuple[tuple[str, float], ...] = (),
    norms: tuple[str, ...] = ("attn_norm", "ffn_norm"),
) -> None:
    """A GGUF of ``arch`` with this module's attention and little else; ``u32``/``f32``: its own header keys
    (after the shared ones), ``norms``: the per-layer norms its graph reads."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_uint32("general.file_type", 1)
    writer.add_string("general.name", name)
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
        *u32,
    ):
        writer.add_uint32(f"{arch}.{key}", value)
    for key, number in (("attention.layer_norm_rms_epsilon", 1e-6), ("rope.freq_base", 1000000.0), *f32):
        writer.add_float32(f"{arch}.{key}", number)
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
        for norm in norms:
            vector(f"blk.{il}.{norm}.weight", N_EMBD)
        weight(f"blk.{il}.attn_q.weight", N_EMBD, N_HEAD * HEAD)
        weight(f"blk.{il}.attn_k.weight", N_EMBD, N_HEAD_KV * HEAD)
        weight(f"blk.{il}.attn_v.weight", N_EMBD, N_HEAD_KV * HEAD)
        weight(f"blk.{il}.attn_output.weight", N_HEAD * HEAD, N_EMBD)
        vector(f"blk.{il}.attn_q_norm.weight", HEAD)
        vector(f"blk.{il}.attn_k_norm.weight", HEAD)
        weight(f"blk.{il}.ffn_gate.weight", N_EMBD, N_FF)
        weight(f"blk.{il}.ffn_up.weight", N_EMBD, N_FF)
        weight(f"blk.{il}.ffn_down.weight", N_FF, N_EMBD)
    for tensor, data in tensors.items():
        writer.add_tensor(tensor, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
