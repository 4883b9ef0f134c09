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
import os
import struct
from pathlib import Path
from typing import BinaryIO

from sidecar.core import safeio

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
    try:
        fd, _ = safeio.open_regular(path, follow=True)
    except safeio.Refused as exc:
        raise ValueError(str(exc)) from exc
    with os.fdopen(fd, "rb") as fh:
        keys = _keys(fh)
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


_GGUF = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_KEYS = 1 << 16


def _keys(fh: BinaryIO) -> dict[str, object]:
    """The header's scalar and string values, and its arrays of integers (other arrays skipped)."""
    if fh.read(4) != _GGUF:
        raise ValueError("not a GGUF file (no 'GGUF' magic)")
    (version,) = struct.unpack("<I", _exact(fh, 4))
    if version < 2:
        raise ValueError(f"GGUF version {version} is too old to read")
    _, n_kv = struct.unpack("<QQ", _exact(fh, 16))
    if n_kv > _MAX_KEYS:
        raise ValueError(f"GGUF header claims {n_kv} keys")
    found: dict[str, object] = {}
    for _ in range(n_kv):
        key = _string(fh)
        (vtype,) = struct.unpack("<I", _exact(fh, 4))
        if vtype in _SCALARS:
            fmt = _SCALARS[vtype]
            found[key] = struct.unpack(fmt, _exact(fh, struct.calcsize(fmt)))[0]
        elif vtype == _STRING:
            found[key] = _string(fh)
        elif vtype == _ARRAY:
            item, count = struct.unpack("<IQ", _exact(fh, 12))
            if item in _SCALARS and item not in (6, 7, 12) and count <= 4096:
                fmt = _SCALARS[item]
                found[key] = list(struct.unpack(f"<{count}{fmt[1]}", _exact(fh, count * struct.calcsize(fmt))))
            else:
                for _ in range(count):
                    _skip(fh, item)
        else:
            raise ValueError(f"GGUF value type {vtype} is unknown")
    return found


def _skip(fh: BinaryIO, vtype: int) -> None:
    if vtype in _SCALARS:
        fh.seek(struct.calcsize(_SCALARS[vtype]), 1)
    elif vtype == _STRING:
        (n,) = struct.unpack("<Q", _exact(fh, 8))
        fh.seek(n, 1)
    elif vtype == _ARRAY:
        item, count = struct.unpack("<IQ", _exact(fh, 12))
        if item in _SCALARS:
            fh.seek(count * struct.calcsize(_SCALARS[item]), 1)
        else:
            for _ in range(count):
                _skip(fh, item)
    else:
        raise ValueError(f"GGUF value type {vtype} is unknown")


def _exact(fh: BinaryIO, n: int) -> bytes:
    data = fh.read(n)
    if len(data) != n:
        raise ValueError("GGUF header ends early")
    return data


def _string(fh: BinaryIO) -> str:
    (n,) = struct.unpack("<Q", _exact(fh, 8))
    if n > 1 << 30:
        raise ValueError("GGUF string too long")
    return _exact(fh, n).decode("utf-8", errors="replace")
