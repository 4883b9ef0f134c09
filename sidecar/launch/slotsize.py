"""The largest slot file a llama-server command can write: KV bytes per token times the context, from the GGUF header.

The RAM staging dir is chosen before llama-server starts (:mod:`.places`), so the size of a slot file
is estimated from what the command says (model, ``-c``, ``-ctk``/``-ctv``) and what the model file's
header says (layers, KV heads, head sizes, trained context). It is an upper bound: every layer is
counted at every position (a sliding window's layers and a hybrid's recurrent layers hold less), and a
unified KV buffer lets one slot hold the whole context. :func:`slot_bytes` is pure; :func:`of_model`
reads the header.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from sidecar.core import gguf

TYPE_BYTES: dict[str, float] = {
    "f32": 4.0,
    "f16": 2.0,
    "bf16": 2.0,
    "q8_0": 34 / 32,
    "q5_1": 24 / 32,
    "q5_0": 22 / 32,
    "q4_1": 20 / 32,
    "q4_0": 18 / 32,
    "iq4_nl": 18 / 32,
}
"""Bytes per element of llama-server's ``--cache-type-k``/``-v`` choices."""


@dataclasses.dataclass(frozen=True, slots=True)
class Shape:
    """What the KV cache of a model holds per token, from its GGUF header."""

    layers: int
    kv_heads: tuple[int, ...]
    """KV heads per layer (one value for every layer, or one per layer; 0: a layer without attention)."""
    key_length: int
    value_length: int
    context_length: int


def slot_bytes(shape: Shape, *, ctx_size: int, cache_type_k: str = "f16", cache_type_v: str = "f16") -> int:
    """Bytes of a slot file holding the whole context (``ctx_size``; 0: the model's own). Pure."""
    heads = shape.kv_heads if len(shape.kv_heads) == shape.layers else shape.kv_heads[:1] * shape.layers
    per_token = sum(heads) * (
        shape.key_length * TYPE_BYTES.get(cache_type_k, 2.0) + shape.value_length * TYPE_BYTES.get(cache_type_v, 2.0)
    )
    tokens = ctx_size if ctx_size > 0 else shape.context_length
    return int(per_token * tokens) + 4 * tokens  # and the token ids


def of_model(path: Path) -> Shape:
    """The KV shape of the GGUF model at ``path``; raises OSError or ValueError if it cannot be read."""
    keys = gguf.read_keys(path)
    arch = keys.get("general.architecture")
    if not isinstance(arch, str):
        raise ValueError("no general.architecture in the GGUF header")

    def number(name: str, default: int | None = None) -> int:
        value = keys.get(f"{arch}.{name}", default)
        if not isinstance(value, int):
            raise ValueError(f"no {arch}.{name} in the GGUF header")
        return value

    layers = number("block_count")
    head_count = keys.get(f"{arch}.attention.head_count", 1)
    heads = (
        max((int(v) for v in head_count), default=1)
        if isinstance(head_count, list)
        else number("attention.head_count", 1)
    )
    kv = keys.get(f"{arch}.attention.head_count_kv", heads)
    if isinstance(kv, list):
        kv_heads = tuple(int(v) for v in kv)
    elif isinstance(kv, int):
        kv_heads = (kv,)
    else:
        raise ValueError(f"{arch}.attention.head_count_kv is not a number")
    head_size = number("embedding_length") // max(heads, 1)
    return Shape(
        layers=layers,
        kv_heads=kv_heads,
        key_length=number("attention.key_length", head_size),
        value_length=number("attention.value_length", head_size),
        context_length=number("context_length", 4096),
    )
