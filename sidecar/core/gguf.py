"""The key-value header of a GGUF model file: the one reader the sidecar has.

Read for the model's memory kind and window (``sidecar.observe.memory``) and for the size of its KV cache
per token (``sidecar.launch.slotsize``). Only the header is read, never a tensor: scalars and strings are
kept, arrays of integers up to :data:`MAX_ARRAY` items (a per-layer value such as ``head_count_kv``) are
kept as lists, every other array (the vocabulary) is skipped in place. Anything that does not parse as a
GGUF header raises ``ValueError`` with what was wrong.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import BinaryIO

from sidecar.core import safeio

MAGIC = b"GGUF"
MAX_KEYS = 1 << 16
"""More keys than any model file holds: a header that claims more is not read."""
MAX_ARRAY = 4096
"""Arrays of integers up to this many items are kept (one value per layer); longer ones are skipped."""
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_INTEGERS = frozenset(_SCALARS) - {6, 7, 12}
_STRING, _ARRAY = 8, 9

Value = int | float | bool | str | list[int]


def read_keys(path: Path) -> dict[str, Value]:
    """The header of the GGUF file at ``path``; raises OSError, or ValueError if it is not one.

    Only a regular file is opened (a FIFO's open would never return): anything else is a ValueError.
    """
    try:
        fd, _ = safeio.open_regular(path, follow=True)
    except safeio.Refused as exc:
        raise ValueError(str(exc)) from exc
    with os.fdopen(fd, "rb") as fh:
        return keys(fh)


def keys(fh: BinaryIO) -> dict[str, Value]:
    """The header's scalar and string values, and its short arrays of integers (other arrays skipped)."""
    if fh.read(4) != MAGIC:
        raise ValueError("not a GGUF file (no 'GGUF' magic)")
    (version,) = struct.unpack("<I", _exact(fh, 4))
    if version < 2:
        raise ValueError(f"GGUF version {version} is too old to read")
    _, n_kv = struct.unpack("<QQ", _exact(fh, 16))
    if n_kv > MAX_KEYS:
        raise ValueError(f"GGUF header claims {n_kv} keys")
    found: dict[str, Value] = {}
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
            if item in _INTEGERS and count <= MAX_ARRAY:
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


def _string(fh: BinaryIO) -> str:
    (n,) = struct.unpack("<Q", _exact(fh, 8))
    return _exact(fh, n).decode("utf-8", errors="replace")


def _exact(fh: BinaryIO, n: int) -> bytes:
    data = fh.read(n)
    if len(data) != n:
        raise ValueError("GGUF header ends early")
    return data
