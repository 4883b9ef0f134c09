"""The token ids at the head of a llama-server slot file, and prefix hashes over them. Pure code.

Invariants and trade-offs: docs/modules.md, `sidecar/snapshots/slotfile.py`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import struct
from pathlib import Path
from typing import BinaryIO

from sidecar.core import safeio

MAGIC = 0x67677371
"""``LLAMA_STATE_SEQ_MAGIC`` ("ggsq")."""
VERSION = 4
"""``LLAMA_STATE_SEQ_VERSION`` of the pinned llama.cpp."""
PACKED_MARKER = 0xFFFFFFFF
"""``LLAMA_TOKEN_NULL`` (-1) as the first word: llama-server's packed token state follows."""
PACKED_VERSION = 1
"""``SERVER_TOKENS_STATE_VERSION`` of the pinned llama.cpp."""
BLOCK_TOKENS = 128
"""Tokens per hashed block: a prefix is matched to this granularity."""
_HEAD = struct.Struct("<III")
HEAD_BYTES = _HEAD.size
"""Bytes of the header (magic, version, word count)."""
_WORD = 4


class SlotFileError(ValueError):
    """The file is not a slot file this module can read; ``reason`` says why in one word."""

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclasses.dataclass(frozen=True, slots=True)
class SlotTokens:
    """The token ids a slot file holds, as raw little-endian 32-bit words."""

    data: bytes

    @property
    def count(self) -> int:
        return len(self.data) // _WORD


def read_tokens(path: Path) -> SlotTokens:
    """Read the token ids at the head of the slot file at ``path``; raise SlotFileError if unreadable."""
    fd, st = safeio.open_regular(path)  # never a link out of the slot dir, never a FIFO or device
    with os.fdopen(fd, "rb") as fh:
        return read_tokens_from(fh, st.st_size, path.name)


def head_size(head: bytes) -> int:
    """Bytes of the header and token words, from the first :data:`HEAD_BYTES` of a slot file."""
    _, _, n_words = _HEAD.unpack(head[:HEAD_BYTES])
    return int(HEAD_BYTES + n_words * _WORD)


def read_tokens_from(fh: BinaryIO, size: int, name: str) -> SlotTokens:
    """Read the token ids from ``fh``, at the start of a slot file of ``size`` bytes named ``name``."""
    head = fh.read(_HEAD.size)
    if len(head) < _HEAD.size:
        raise SlotFileError(f"{name} is shorter than a slot file header", reason="short")
    magic, version, n_words = _HEAD.unpack(head)
    if magic != MAGIC:
        raise SlotFileError(f"{name} does not start with the slot file magic 'ggsq'", reason="magic")
    if version != VERSION:
        raise SlotFileError(
            f"{name} is slot file version {version}; this sidecar reads version {VERSION}",
            reason="version",
        )
    if _HEAD.size + n_words * _WORD > size:
        raise SlotFileError(f"{name} declares {n_words} token words but holds {size} bytes", reason="truncated")
    words = fh.read(n_words * _WORD)
    if len(words) < n_words * _WORD:
        raise SlotFileError(f"{name} ended inside its token words", reason="truncated")
    return SlotTokens(_unpack(words, name))


def _unpack(words: bytes, name: str) -> bytes:
    """The token ids inside the word payload: packed server state, or a plain list."""
    if len(words) < _WORD:
        return b""
    (first,) = struct.unpack_from("<I", words, 0)
    if first != PACKED_MARKER:
        return words  # a plain token list, as older servers wrote it
    if len(words) < 3 * _WORD:
        raise SlotFileError(f"{name} has a packed token state too short for its header", reason="truncated")
    version, n_tokens = struct.unpack_from("<II", words, _WORD)
    if version != PACKED_VERSION:
        raise SlotFileError(
            f"{name} holds packed token state version {version}; this sidecar reads version {PACKED_VERSION}",
            reason="version",
        )
    end = 3 * _WORD + n_tokens * _WORD
    if end > len(words):
        raise SlotFileError(f"{name} declares {n_tokens} tokens beyond its token payload", reason="truncated")
    return words[3 * _WORD : end]


def prefix_hashes(tokens: bytes, *, block: int = BLOCK_TOKENS) -> tuple[str, ...]:
    """Chained hashes of each full block of ``tokens`` (raw little-endian 32-bit ids).

    Hash ``i`` covers hash ``i - 1`` and block ``i``, so equal hashes at
    position ``i`` mean equal token prefixes of ``(i + 1) * block`` ids. A
    partial last block is not hashed.
    """
    step = block * _WORD
    chain: list[str] = []
    parent = b""
    for start in range(0, len(tokens) - step + 1, step):
        digest = hashlib.blake2b(parent + tokens[start : start + step], digest_size=16).digest()
        chain.append(digest.hex())
        parent = digest
    return tuple(chain)


def pack_ids(ids: list[int]) -> bytes:
    """Token ids (from ``/tokenize``) as the raw words :func:`prefix_hashes` takes."""
    return struct.pack(f"<{len(ids)}i", *ids)


def unpack_ids(tokens: bytes) -> list[int]:
    """The token ids in raw little-endian 32-bit words (the inverse of :func:`pack_ids`)."""
    return list(struct.unpack(f"<{len(tokens) // _WORD}i", tokens[: len(tokens) // _WORD * _WORD]))


def whole_hash(tokens: bytes) -> str:
    """One hash of every id in ``tokens`` (the partial last block included): equal exactly when the ids are."""
    return hashlib.blake2b(b"whole:" + tokens, digest_size=16).hexdigest()


def shared_blocks(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    """How many leading blocks two hash chains share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
