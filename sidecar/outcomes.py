"""The closed vocabularies of what a save or a restore came to.

Each word is a metric label value (``snapshots_total{result}``,
``restores_total{result}``, ``restore_verifications_total{outcome}``), so
:mod:`sidecar.metrics` builds its pre-initialised label sets from these
enums, and callers match on members, never on message text.
"""

from __future__ import annotations

import enum


class SaveResult(enum.StrEnum):
    """``snapshots_total{result}``."""

    OK = "ok"
    FAILED = "failed"
    SKIPPED = "skipped"


class SaveCause(enum.StrEnum):
    """Why a save did not end ``ok``: what the engine does next depends on it."""

    BELOW_MIN_TOKENS = "below_min_tokens"
    """Skipped: the slot holds fewer tokens than ``--min-tokens``; settled until it changes."""
    EMPTY = "empty"
    """Skipped: the server saved 0 tokens; settled until it changes."""
    LOW_DISK = "low_disk"
    """Skipped: the filesystem would drop below ``--min-free-bytes``; tried again later."""
    SLOT_BUSY = "slot_busy"
    """Skipped: the slot was processing when read right before the save (nothing is sent to a
    busy slot: the server would hold the call until the request ends); saved once it is idle."""
    NOT_LINKED = "not_linked"
    """Failed: the server's file did not appear in the slot dir (another directory)."""
    NOT_SUPPORTED = "not_supported"
    """Failed: the server answers 501 (no ``--slot-save-path``)."""
    SERVER = "server"
    """Failed: the server refused, timed out or could not be reached."""
    CHECK = "check"
    """Failed: the file the server wrote failed the sidecar's size check, or could not be committed."""
    SLOT_DIR = "slot_dir"
    """Failed: the slot dir could not be read or measured (moved, removed, I/O error); tried again later."""


SKIP_CAUSES = frozenset({SaveCause.BELOW_MIN_TOKENS, SaveCause.EMPTY, SaveCause.LOW_DISK, SaveCause.SLOT_BUSY})


class RestoreOutcome(enum.StrEnum):
    """``restores_total{result}``."""

    OK = "ok"
    FAILED = "failed"
    INCOMPATIBLE = "incompatible"
    NO_SNAPSHOT = "no_snapshot"
    SLOT_BUSY = "slot_busy"
    RACED = "raced"
    """A request ran on the slot while the restore call was in flight: the server deferred the
    restore behind it, and the restore then replaced that request's KV."""


class Verification(enum.StrEnum):
    """``restore_verifications_total{outcome}``."""

    EFFECTIVE = "effective"
    INEFFECTIVE = "ineffective"
