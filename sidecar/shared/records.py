"""The shared manifest: the object that publishes one snapshot in the shared store. Pure code.

It is written after the snapshot's blob, so a listed manifest always names
a complete object. It carries the local manifest as it was committed (size,
checksum, token count, the fingerprint of the server that wrote it), the
blob's key and the prefix hash chain of the snapshot's tokens
(``slotfile.prefix_hashes``), which is what a lookup matches a request
against. A snapshot whose tokens could not be read is still shared with an
empty chain: a node can fetch it by slot at start-up, a lookup never finds it.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from sidecar.snapshots import manifest

FORMAT = 1
"""A snapshot uploaded whole, as one blob."""
FORMAT_BLOCKS = 2
"""A snapshot uploaded as blocks: ``recipe`` names the object listing them; ``blob`` is empty.
A sidecar older than this format refuses such a manifest as unreadable (its hint says to upgrade)."""


@dataclasses.dataclass(frozen=True, slots=True)
class SharedRecord:
    snapshot: manifest.Manifest
    blob: str
    """Key of the snapshot file's object."""
    chain: tuple[str, ...]
    """Prefix hashes of the snapshot's tokens, one per full block."""
    block_tokens: int
    uploaded: float
    """Unix time the uploading node published it."""
    recipe: str = ""
    """Key of the recipe object listing the snapshot's blocks (a block upload); empty for a whole blob."""

    @property
    def key(self) -> str:
        """The object that holds the snapshot's bytes: its blob, or its recipe."""
        return self.recipe or self.blob

    def to_json(self) -> str:
        body: dict[str, Any] = {
            "format": FORMAT_BLOCKS if self.recipe else FORMAT,
            "snapshot": json.loads(self.snapshot.to_json()),
            "blob": self.blob,
            "chain": list(self.chain),
            "block_tokens": self.block_tokens,
            "uploaded": self.uploaded,
        }
        if self.recipe:
            body["recipe"] = self.recipe
        return json.dumps(body, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes) -> SharedRecord:
        """Parse a shared manifest; ValueError (or manifest.NewerFormatError) names what is wrong."""
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("shared manifest is not a JSON object")
        fmt = raw.get("format")
        if fmt not in (FORMAT, FORMAT_BLOCKS):
            raise ValueError(f"shared manifest format {fmt!r} is not {FORMAT} or {FORMAT_BLOCKS}")
        snapshot = manifest.Manifest.from_json(json.dumps(_get(raw, "snapshot", dict)))
        chain = _get(raw, "chain", list)
        if not all(isinstance(h, str) for h in chain):
            raise ValueError("shared manifest chain holds a non-string")
        block = _get(raw, "block_tokens", int)
        uploaded = raw.get("uploaded")
        if not isinstance(uploaded, int | float) or isinstance(uploaded, bool):
            raise ValueError("shared manifest field 'uploaded' is not a number")
        recipe = _get(raw, "recipe", str) if fmt == FORMAT_BLOCKS else ""
        if fmt == FORMAT_BLOCKS and not recipe:
            raise ValueError("shared manifest of blocks names no recipe")
        return cls(snapshot, _get(raw, "blob", str), tuple(chain), block, float(uploaded), recipe)


def _get(raw: dict[str, Any], key: str, kind: type) -> Any:
    value = raw.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"shared manifest field {key!r} is not a {kind.__name__}")
    return value
