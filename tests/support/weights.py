"""Model files with other weights of the same shape: what a fine-tune copied over a model file looks like."""

from __future__ import annotations

import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

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


_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def _value(fh: BinaryIO, kind: int) -> Any:
    if kind == 8:
        return fh.read(_u64(fh)).decode(errors="replace")
    if kind == 9:
        inner, count = _u32(fh), _u64(fh)
        return [_value(fh, inner) for _ in range(count)]
    return struct.unpack(_FORMATS[kind], fh.read(_SCALARS[kind]))[0]


def header_values(path: Path, wanted: Callable[[str], bool]) -> dict[str, Any]:
    """The values of the keys ``wanted`` picks in a GGUF file's header (those it has), the others skipped unread.

    ``gguf.GGUFReader`` parses every field, a 262,144-token vocabulary included (seconds); this reads what it needs.
    """
    found: dict[str, Any] = {}
    with path.open("rb") as fh:
        assert fh.read(4) == b"GGUF"
        assert _u32(fh) >= 2
        _, n_kv = _u64(fh), _u64(fh)
        for _ in range(n_kv):
            key = fh.read(_u64(fh)).decode()
            kind = _u32(fh)
            if wanted(key):
                found[key] = _value(fh, kind)
            else:
                _skip_value(fh, kind)
    return found


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


def rewrite_weights(path: Path) -> None:
    """Flip 64 bytes in the middle of the tensor data: other weights, same size, same shapes."""
    size = path.stat().st_size
    start = tensor_data_offset(path)
    assert start < size // 2
    with path.open("r+b") as fh:
        fh.seek(start + (size - start) // 2)
        chunk = fh.read(64)
        fh.seek(-len(chunk), 1)
        fh.write(bytes(b ^ 0x01 for b in chunk))
    assert path.stat().st_size == size


def other_weights(model: Path, into: Path) -> Path:
    """A copy of ``model`` at ``into`` with other weights (see :func:`rewrite_weights`)."""
    shutil.copyfile(model, into)
    rewrite_weights(into)
    return into
