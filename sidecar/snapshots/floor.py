"""What a save writes on which filesystem, held against ``--min-free-bytes``. Pure code.

Whole files (no ``--store-dir``): llama-server writes the whole slot file into the slot dir, which keeps
it; the floor guards the slot dir's filesystem against that file, as it always did.

Block store (``--store-dir``): llama-server writes the whole file into the slot dir, which only stages it
(normally a tmpfs, governed by :func:`.spill.fits`, not by the floor), and the store's disk keeps only the
blocks it lacks: the tokens beyond what it already holds of the slot's content, each layer's last partial
block of that part rewritten, the part of the file that does not grow with the tokens (a sliding window,
a recurrent state: written again at every save), and the recipe and manifest. The staged file lands on
the store's disk too when the slot dir lacks room for it (a spill) or is on the same filesystem. The
floor guards the store's disk against that sum: a 6 GB slot whose new tail is 50 MB needs about 50 MB
there, not 6 GB.

What the store holds of the slot's content is an estimate: the slot's newest snapshot, when it holds fewer
tokens than the slot now (a conversation grows in its slot; a changed slot with as many tokens or fewer
holds another one). A slot that took another conversation
since writes more than estimated; a disk that fills for real is then the store-fault path's
(``snapshot_store_unwritable``), which keeps committed snapshots and resumes by itself.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

from sidecar.snapshots import spill

BLOCK_TOKENS = 256
"""Tokens of one block of a layer (``sidecar.blocks.layout.TOKENS``): a snapshot's last, partial block of
each layer is written again when the slot grows past it."""
OVERHEAD_BYTES = 64 << 10
"""Bytes a commit writes beyond the blocks, at least (the snapshot's manifest, its recipe's head)."""
RECIPE_SHARE = 1024
"""A recipe lists every block of the whole file: about one byte per this many bytes of it (measured
below one in 1,300 with 256-token blocks of a small model's layers)."""


class Disk(enum.StrEnum):
    """The filesystem a floor check measured (``snapshot_skipped_low_disk``'s ``disk``)."""

    SLOT_DIR = "slot_dir"
    """Whole files: the slot dir keeps them."""
    STORE = "store"
    """The block store's disk (``--store-dir``)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Estimate:
    """What one save would write on one filesystem, and what that filesystem has free."""

    disk: Disk
    bytes: int
    """Bytes the save writes there, at most about (0 before any snapshot gave a size per token)."""
    free_bytes: int
    staged: bool = False
    """``bytes`` counts the whole staged file (the slot dir lacks room for it, or is this filesystem)."""

    def short(self, floor: int) -> int:
        """Bytes to free before the save leaves ``floor`` bytes free; 0: it fits."""
        return max(0, self.bytes + floor - self.free_bytes)


def fixed_bytes(sizes: Sequence[tuple[int, int]]) -> int | None:
    """The part of a slot file that does not grow with its tokens, fitted from ``(tokens, bytes)`` of snapshots
    of one model, the newest first; None without two of them ``BLOCK_TOKENS`` or more apart.

    A save writes it again whatever the store holds: a sliding window's rows move with the tokens, a
    recurrent state is rewritten (measured on Gemma 3: 7.8 MB of a 14 MB file, and each 100 tokens more
    wrote 9 MB of new blocks). The fit takes the newest and the one farthest from it in tokens.
    """
    if len(sizes) < 2:
        return None
    tokens, size = sizes[0]
    other = max(sizes[1:], key=lambda s: abs(s[0] - tokens))
    if abs(other[0] - tokens) < BLOCK_TOKENS:
        return None
    per_token = max(0.0, (size - other[1]) / (tokens - other[0]))
    return max(0, min(size, round(size - per_token * tokens)))


def whole_file(sizes: Sequence[tuple[int, int]], tokens: int) -> int:
    """A whole slot file of ``tokens`` for a block store, from ``(tokens, bytes)`` of snapshots of one model,
    the newest first: its fixed part (:func:`fixed_bytes`) and the newest's bytes per token beyond it; without
    a fit, the newest's bytes per token (0 before any snapshot)."""
    if not sizes:
        return 0
    newest_tokens, newest_bytes = sizes[0]
    fixed = fixed_bytes(sizes)
    if fixed is None:
        return int(newest_bytes / max(newest_tokens, 1) * tokens)
    return fixed + int((newest_bytes - fixed) / max(newest_tokens, 1) * tokens)


def tail_bytes(*, tokens: int, held_tokens: int, whole_bytes: int, fixed: int | None) -> int:
    """Bytes of new blocks a save of ``tokens`` writes when the store holds the first ``held_tokens`` of them.

    ``whole_bytes``: the whole file's estimated size (``tokens`` of it); ``fixed``: the part of it written
    again at every save (:func:`fixed_bytes`). Nothing held, or no fit: the whole file.
    """
    if tokens <= 0 or held_tokens <= 0 or held_tokens >= tokens or fixed is None:
        return whole_bytes  # a slot saved again at as many tokens or fewer holds another conversation
    fixed = min(fixed, whole_bytes)
    new = min(tokens, tokens - held_tokens + BLOCK_TOKENS)
    return fixed + (whole_bytes - fixed) * new // tokens


def whole_files(*, whole_bytes: int, free_bytes: int) -> Estimate:
    """No block store: the slot dir's filesystem takes the whole file."""
    return Estimate(Disk.SLOT_DIR, whole_bytes, free_bytes)


def block_store(
    *, whole_bytes: int, new_bytes: int, store_free: int, staging_free: int | None, shares_disk: bool
) -> Estimate:
    """A block store: the store's disk takes the new blocks and the commit's files, and the staged file when
    the slot dir (``staging_free`` free, None: not measured, taken as roomy) lacks room or is that disk."""
    if not whole_bytes:
        return Estimate(Disk.STORE, 0, store_free)
    staged = shares_disk or (staging_free is not None and not spill.fits(staging_free, whole_bytes))
    total = new_bytes + OVERHEAD_BYTES + whole_bytes // RECIPE_SHARE + (whole_bytes if staged else 0)
    return Estimate(Disk.STORE, total, store_free, staged)
