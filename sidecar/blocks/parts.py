"""The pieces of a plan: where a file is cut into blocks and what each piece holds. Pure code."""

from __future__ import annotations

import dataclasses
import enum


class Region(enum.StrEnum):
    """What the bytes of a part are: reported per region, so dedup can be read per kind."""

    HEADER = "header"
    TOKENS = "tokens"
    CELLS = "cells"
    KEYS = "keys"
    VALUES = "values"
    OPAQUE = "opaque"
    """Chunked by content: a layout the parser does not know (recurrent state, another version)."""
    GLUE = "glue"
    """A few header bytes (counts, a layer's type and row size): never a part of a plan, they are
    merged into the block that follows them (see ``layout._coalesce``)."""


class Layout(enum.StrEnum):
    """How a whole file was split."""

    KV = "kv"
    """Every byte after the token payload parsed as KV cache sections."""
    MIXED = "mixed"
    """KV cache sections, then bytes chunked by content (a hybrid model's recurrent state)."""
    OPAQUE = "opaque"
    """Nothing recognised beyond the header: chunked by content."""


@dataclasses.dataclass(frozen=True, slots=True)
class Run:
    """``sum(cuts)`` contiguous bytes at ``offset``, one block per cut."""

    offset: int
    cuts: tuple[int, ...]
    region: Region
    fine: tuple[tuple[int, ...], ...] = ()
    """Empty, or per cut its finer split (``()``: none): the ingest stores cut ``i`` as the blocks of
    ``fine[i]`` instead of one block when the store holds the first of them (see ``ingest``)."""

    @property
    def length(self) -> int:
        return sum(self.cuts)


@dataclasses.dataclass(frozen=True, slots=True)
class Grid:
    """``rows`` rows of ``sum(cuts)`` bytes at ``offset``; block ``i`` is column range ``i`` of every row."""

    offset: int
    rows: int
    cuts: tuple[int, ...]
    region: Region
    fine: tuple[tuple[int, ...], ...] = ()
    """As :attr:`Run.fine`, in bytes of a row."""

    @property
    def length(self) -> int:
        return self.rows * sum(self.cuts)


Part = Run | Grid


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    parts: tuple[Part, ...]
    layout: Layout
