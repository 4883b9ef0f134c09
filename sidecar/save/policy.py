"""When to save a slot and what to delete: pure decisions.

:class:`Policy` keeps one :class:`SlotTrack` per slot and is fed the slots of
every poll; :meth:`Policy.due` says which saves are due now. It never
proposes a save of a busy slot, and the caller runs at most one save at a
time. :func:`select_for_deletion` and :func:`select_for_space` are plain
functions of their inputs; what to restore where is :mod:`sidecar.restore.plan`'s.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Collection, Iterable, Sequence

from sidecar.core import config, events, outcomes
from sidecar.save import stallweigh
from sidecar.snapshots import manifest, retention


class SaveReason(enum.StrEnum):
    IDLE = "idle"
    PERIODIC = "periodic"
    FINAL = "final"
    MANUAL = "manual"
    SWAP = "swap"
    """The slot is about to receive another conversation from the library: its own is saved first."""


@dataclasses.dataclass(frozen=True, slots=True)
class Save:
    slot: int
    signature: events.SlotContent
    tokens: int
    reason: SaveReason


@dataclasses.dataclass(frozen=True, slots=True)
class Skip:
    """A changed slot that will not be saved, reported once per content."""

    slot: int
    signature: events.SlotContent
    why: str


@dataclasses.dataclass(slots=True)
class SlotTrack:
    signature: events.SlotContent | None = None
    busy: bool = False
    changed_at: float = 0.0
    """When the content (or the busy flag) last changed, monotonic seconds."""
    dirty_since: float | None = None
    """First change not covered by a snapshot."""
    settled: events.SlotContent | None = None
    """Content already saved, restored, or judged not worth saving."""
    retry_at: float = 0.0
    """No save before this monotonic time (after a failed save)."""
    read_at: float = float("-inf")
    """When the newest /slots listing the track follows was read (monotonic seconds)."""
    kept_tokens: int = 0
    """Tokens of the content the slot's newest snapshot in this server process holds (saved or restored);
    0: none, or the slot has held fewer tokens since (another content: what it holds now is all unsaved)."""


class Policy:
    def __init__(self, settings: config.SnapshotSettings) -> None:
        self.settings = settings
        self.tracks: dict[int, SlotTrack] = {}

    def reset(self) -> None:
        """Forget every slot: the server process changed."""
        self.tracks.clear()

    def observe(self, slots: Iterable[events.SlotView], now: float, *, read_at: float | None = None) -> None:
        """Follow each slot's content; ``read_at``: when the listing was read (None: ``now``).

        A listing read before one the policy already follows is stale (the
        poller carries its last listing over while slots generate, and a save
        reads the slot afresh in between): it is ignored, or an old content
        would look unsaved again and be saved once more.
        """
        read_at = now if read_at is None else read_at
        for view in slots:
            track = self.tracks.setdefault(view.id, SlotTrack(changed_at=now))
            if read_at < track.read_at:
                continue
            track.read_at = read_at
            if view.signature != track.signature or view.processing != track.busy:
                if view.tokens < track.kept_tokens:
                    track.kept_tokens = 0  # not a continuation of what the snapshot holds
                if view.signature not in (track.signature, track.settled):
                    track.dirty_since = track.dirty_since if track.dirty_since is not None else now
                track.signature = view.signature
                track.busy = view.processing
                track.changed_at = now
            if track.signature == track.settled:
                track.dirty_since = None

    def settle(self, slot: int, signature: events.SlotContent | None, *, kept: bool = True) -> None:
        """Mark ``signature`` as covered (saved, restored, or, ``kept`` False, not worth saving)."""
        track = self.tracks.setdefault(slot, SlotTrack())
        track.settled = signature
        if kept and signature is not None:
            track.kept_tokens = signature.tokens
        if track.signature == signature:
            track.dirty_since = None

    def unsettle(self, slot: int, signature: events.SlotContent | None, now: float) -> None:
        """``signature`` was taken as saved but its snapshot was not committed: the slot is due again."""
        track = self.tracks.get(slot)
        if track is None or track.settled != signature:
            return  # settled since by something newer
        track.settled = None
        track.kept_tokens = 0  # what the snapshot before holds is not known here: all of it counts as unsaved
        if track.signature is not None and track.dirty_since is None:
            track.dirty_since = now

    def defer(self, slot: int, until: float) -> None:
        """Propose no save of ``slot`` before ``until`` (a save just failed)."""
        self.tracks.setdefault(slot, SlotTrack()).retry_at = until

    def due(self, now: float) -> list[Save | Skip]:
        actions: list[Save | Skip] = []
        t = self.settings
        for slot, track in sorted(self.tracks.items()):
            sig = track.signature
            if sig is None or track.busy or sig == track.settled or now < track.retry_at:
                continue
            if sig.tokens < t.min_tokens:
                actions.append(Skip(slot, sig, f"holds {sig.tokens} tokens, below --min-tokens {t.min_tokens}"))
                continue
            if now - track.changed_at >= t.idle_seconds:
                actions.append(Save(slot, sig, sig.tokens, SaveReason.IDLE))
            elif track.dirty_since is not None and now - track.dirty_since >= t.interval:
                actions.append(Save(slot, sig, sig.tokens, SaveReason.PERIODIC))
        return actions

    def may_hold(self, slot: int, now: float) -> bool:
        """Whether a due save of ``slot`` may wait for a moment when no other slot is processing.

        A save stalls every slot of the server; held, it lands between
        generations instead. The hold ends once the slot's oldest unsaved change
        is ``hold_seconds`` old, and never later than ``interval``; past it the
        save is weighed (:meth:`weigh`). With ``hold_seconds`` 0 a due save is
        never held.
        """
        track = self.tracks.get(slot)
        cap = min(self.settings.hold_seconds, self.settings.interval)
        if track is None or cap <= 0:
            return False
        return track.dirty_since is None or now - track.dirty_since < cap

    def weigh(self, slot: int, *, rate: float | None, pace: float | None) -> stallweigh.Weighing | None:
        """Whether a save of ``slot`` past its hold is worth its stall (``rate``: prefill tokens per second;
        ``pace``: seconds per token of the last save; see :mod:`.stallweigh`); None: not weighed (the
        slot is not followed, or ``hold_seconds`` 0: never held)."""
        track = self.tracks.get(slot)
        if track is None or track.signature is None or min(self.settings.hold_seconds, self.settings.interval) <= 0:
            return None
        return stallweigh.weigh(
            tokens=track.signature.tokens,
            tail=self.unsaved_tokens(slot),
            rate=rate,
            pace=pace,
            bound=self.settings.max_unsaved_seconds,
        )

    def unsaved_tokens(self, slot: int) -> int:
        """Tokens ``slot`` holds past its newest snapshot, what a crash would have the server re-prefill: a
        content at least as long as the snapshot's is taken to continue it (only token counts are seen)."""
        track = self.tracks.get(slot)
        if track is None or track.signature is None or track.signature == track.settled:
            return 0
        tokens = track.signature.tokens
        return tokens - track.kept_tokens if tokens >= track.kept_tokens else tokens

    def unsaved_since(self, slot: int) -> float | None:
        """When ``slot``'s oldest change no snapshot covers was seen (monotonic seconds); None if none."""
        track = self.tracks.get(slot)
        return track.dirty_since if track is not None else None

    def final(self) -> list[Save]:
        """Saves to take at shutdown: every changed slot worth a file, idle ones first."""
        picks = [
            (track.busy, slot, track.signature)
            for slot, track in self.tracks.items()
            if track.signature is not None
            and track.signature != track.settled
            and track.signature.tokens >= self.settings.min_tokens
        ]
        return [Save(slot, sig, sig.tokens, SaveReason.FINAL) for _, slot, sig in sorted(picks)]


EXACT_MEMORY = frozenset({events.Memory.RECURRENT.value, events.Memory.HYBRID.value, events.Memory.SWA.value})
"""Memory kinds (``Fingerprint.memory``) whose snapshots serve only requests that contain all their tokens."""


def select_for_deletion(
    snapshots: Sequence[manifest.Manifest],
    *,
    keep_per_slot: int,
    max_bytes: int,
    max_age: float,
    now: float,
    in_use: Collection[str] = (),
    last_used: Callable[[str], float] | None = None,
    covers: Callable[[manifest.Manifest, manifest.Manifest], bool] | None = None,
    blocks: Callable[[manifest.Manifest], tuple[tuple[str, int], ...]] | None = None,
) -> list[tuple[manifest.Manifest, outcomes.GcReason]]:
    """Snapshots to delete under the retention rules.

    ``blocks``: a snapshot's blocks in a block store, so ``max_bytes`` counts shared blocks once.

    Conversations are the unit of keeping (see ``library.retention``): a
    snapshot indexed by content goes when ``keep_per_slot`` newer snapshots
    extend it, or, least recently used first, under ``max_bytes`` and
    ``max_age``. Snapshots without an index keep the per-slot rule: the
    newest ``keep_per_slot`` of a slot. Never selected: the newest snapshot
    of each slot (a slot always keeps its last good snapshot) and ``in_use``. Snapshots of a
    model that cannot cut a state back are superseded to the token only (``covers``, see
    ``retention.select``).
    """
    by_slot = _by_slot(snapshots)
    protected = {group[0].file for group in by_slot.values()} | set(in_use)
    doomed: dict[str, tuple[manifest.Manifest, outcomes.GcReason]] = {}
    for group in by_slot.values():
        for snap in group[max(1, keep_per_slot) :]:
            if snap.index is None or not snap.index.chain:
                doomed[snap.file] = (snap, outcomes.GcReason.KEEP)
    by_file = {s.file: s for s in snapshots}
    kept = _kept([s for s in snapshots if s.file not in doomed], last_used=last_used, blocks=blocks)
    exact_covers = None
    if covers is not None:
        cover = covers

        def exact_covers(newer: retention.Kept, older: retention.Kept) -> bool:
            return cover(by_file[newer.file], by_file[older.file])

    for k, why in retention.select(
        kept,
        in_use=protected,
        keep=keep_per_slot,
        max_bytes=max_bytes,
        max_age=max_age,
        now=now,
        covers=exact_covers,
    ):
        doomed[k.file] = (by_file[k.file], why)
    return list(doomed.values())


def select_for_space(
    snapshots: Sequence[manifest.Manifest],
    *,
    need: int,
    free: int,
    floor: int,
    in_use: Collection[str] = (),
    last_used: Callable[[str], float] | None = None,
    blocks: Callable[[manifest.Manifest], tuple[tuple[str, int], ...]] | None = None,
) -> list[manifest.Manifest]:
    """Snapshots to delete, least recently used first, so that a save writing ``need`` bytes on a disk with
    ``free`` bytes leaves ``floor`` free; [] when it fits already or deleting all would not make it fit.

    Protected as from every retention rule: the newest snapshot of each slot and ``in_use``. ``blocks``:
    a snapshot's blocks in a block store (the bytes freed count only blocks no kept snapshot names).
    """
    protected = {group[0].file for group in _by_slot(snapshots).values()} | set(in_use)
    by_file = {s.file: s for s in snapshots}
    victims = retention.make_room(
        _kept(snapshots, last_used=last_used, blocks=blocks), in_use=protected, need=need, free=free, floor=floor
    )
    return [by_file[k.file] for k in victims]


def freed_bytes(
    snapshots: Sequence[manifest.Manifest],
    victims: Collection[manifest.Manifest],
    *,
    blocks: Callable[[manifest.Manifest], tuple[tuple[str, int], ...]] | None = None,
) -> int:
    """Bytes on disk deleting ``victims`` frees: whole files, or blocks no other snapshot names."""
    before = _kept(snapshots, last_used=lambda file: 0.0, blocks=blocks)
    gone = {v.file for v in victims}
    return retention.held_bytes(before) - retention.held_bytes(k for k in before if k.file not in gone)


def _by_slot(snapshots: Sequence[manifest.Manifest]) -> dict[int, list[manifest.Manifest]]:
    """Each slot's snapshots, newest first."""
    by_slot: dict[int, list[manifest.Manifest]] = {}
    for snap in manifest.newest_first(snapshots):
        by_slot.setdefault(snap.slot, []).append(snap)
    return by_slot


def _kept(
    snapshots: Sequence[manifest.Manifest],
    *,
    last_used: Callable[[str], float] | None,
    blocks: Callable[[manifest.Manifest], tuple[tuple[str, int], ...]] | None,
) -> list[retention.Kept]:
    """The snapshots as retention sees them (``last_used`` None: their commit time)."""
    used = last_used or {s.file: s.created for s in snapshots}.__getitem__
    return [
        retention.Kept(
            file=s.file,
            prefix=s.index.chain if s.index is not None else (),
            bytes=s.bytes,
            generation=s.generation,
            last_used=used(s.file),
            exact=s.fingerprint.memory in EXACT_MEMORY,
            blocks=blocks(s) if blocks is not None and s.recipe is not None else (),
        )
        for s in snapshots
    ]
