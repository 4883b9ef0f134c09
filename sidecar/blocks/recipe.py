"""The block manifest: which blocks, in which order, rebuild one file. Pure code.

Invariants and trade-offs: docs/modules.md, `sidecar/blocks/recipe.py`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from sidecar.blocks import parts
from sidecar.core import hashing

FORMAT = 1
BLOCK_HASH = "sha256"
MAX_BYTES = 64 << 20
"""Largest recipe read: about 80 bytes per block, so room for 800,000 blocks (a 400 GB file)."""
NAME_RE = re.compile(r"(?a)^[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}$")
"""Recipe names: flat, no leading dot (dot names are the store's temp files)."""
DIGEST_RE = re.compile(r"[0-9a-f]{64}")


@dataclasses.dataclass(frozen=True, slots=True)
class Block:
    digest: str
    """sha256 of the block's bytes, lower-case hex: its name in the store."""
    size: int


@dataclasses.dataclass(frozen=True, slots=True)
class Part:
    region: parts.Region
    rows: int
    """0: the blocks are laid end to end; else each block is a column range of this many rows."""
    blocks: tuple[Block, ...]

    @property
    def size(self) -> int:
        return sum(b.size for b in self.blocks)

    @property
    def width(self) -> int:
        """Bytes per row of a grid."""
        return self.size // self.rows if self.rows else self.size


@dataclasses.dataclass(frozen=True, slots=True)
class Recipe:
    name: str
    size: int
    checksum: str
    """``hashing.CURRENT`` digest of the whole file, hex."""
    algorithm: hashing.Algorithm
    layout: parts.Layout
    created: float
    """Unix time of the commit (for display)."""
    parts: tuple[Part, ...]

    def digests(self) -> set[str]:
        """Every block this recipe needs."""
        return {b.digest for p in self.parts for b in p.blocks}

    def blocks(self) -> list[Block]:
        return [b for p in self.parts for b in p.blocks]

    def to_json(self) -> str:
        body: dict[str, Any] = {
            "format": FORMAT,
            "name": self.name,
            "size": self.size,
            "checksum": {"algorithm": self.algorithm.value, "digest": self.checksum},
            "block_hash": BLOCK_HASH,
            "layout": self.layout.value,
            "created": self.created,
            "parts": [
                {"region": p.region.value, "rows": p.rows, "blocks": [[b.digest, b.size] for b in p.blocks]}
                for p in self.parts
            ],
        }
        return json.dumps(body, separators=(",", ":")) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Recipe:
        """Parse and check a recipe; ValueError names the first thing wrong."""
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("recipe is not a JSON object")
        if raw.get("format") != FORMAT:
            raise ValueError(f"recipe format {raw.get('format')!r} is not {FORMAT}")
        if raw.get("block_hash") != BLOCK_HASH:
            raise ValueError(f"recipe block hash {raw.get('block_hash')!r} is not {BLOCK_HASH}")
        checksum = _field(raw, "checksum", dict)
        recipe = cls(
            name=_field(raw, "name", str),
            size=_count(raw.get("size"), "size"),
            checksum=_field(checksum, "digest", str),
            algorithm=hashing.Algorithm(_field(checksum, "algorithm", str)),
            layout=parts.Layout(_field(raw, "layout", str)),
            created=float(_field(raw, "created", (int, float))),
            parts=tuple(_part(p) for p in _field(raw, "parts", list)),
        )
        if not NAME_RE.match(recipe.name):
            raise ValueError(f"recipe name {recipe.name!r} is not a flat name")
        if not re.fullmatch(f"[0-9a-f]{{{hashing.DIGEST_HEX[recipe.algorithm]}}}", recipe.checksum):
            raise ValueError("recipe checksum is not a hex digest of its algorithm")
        if sum(p.size for p in recipe.parts) != recipe.size:
            raise ValueError(
                f"recipe blocks sum to {sum(p.size for p in recipe.parts)} bytes, not its size {recipe.size}"
            )
        return recipe


def _part(raw: object) -> Part:
    if not isinstance(raw, dict):
        raise ValueError("recipe part is not an object")
    rows = _count(raw.get("rows"), "part rows")
    blocks: list[Block] = []
    for item in _field(raw, "blocks", list):
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)):
            raise ValueError("recipe block is not [digest, size]")
        if not DIGEST_RE.fullmatch(item[0]):
            raise ValueError(f"recipe block digest {item[0][:80]!r} is not 64 hex digits")
        size = _count(item[1], "block size")
        if rows and size % rows:
            raise ValueError(f"grid block {item[0]} of {size} bytes is not a whole number of its {rows} rows")
        blocks.append(Block(item[0], size))
    return Part(parts.Region(_field(raw, "region", str)), rows, tuple(blocks))


def _field(raw: dict[str, Any], key: str, kind: type[Any] | tuple[type[Any], ...]) -> Any:
    value = raw.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"recipe field {key!r} is missing or of the wrong type")
    return value


def _count(value: object, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"recipe {what} is not a non-negative integer")
    return value
