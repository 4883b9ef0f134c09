"""A restore round's plan: which snapshot goes into which slot, and in what order. Pure.

Without waiting requests each empty slot gets its own newest snapshot; snapshots wanted by requests
held at the gate go first, in the order wanted, each into the slot its request will run in;
:func:`plan_restore` says which of them one slot may take.

Invariants and trade-offs: docs/modules.md, `sidecar/restore/plan.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

from sidecar.core import events, outcomes
from sidecar.snapshots import manifest


@dataclasses.dataclass(frozen=True, slots=True)
class Step:
    """Restore one of ``candidates`` (the first that passes its checks) into ``slot``."""

    slot: int
    candidates: tuple[manifest.Manifest, ...]
    """In the order to try them; empty: nothing to restore there (``no_snapshot``)."""
    wanted: str | None = None
    """The file a held request waits for (the first candidate); None: the slot's own content."""


def plan(
    pending: Sequence[int],
    wanted: Sequence[str],
    snapshots: Sequence[manifest.Manifest],
    *,
    done: Collection[str] = (),
) -> tuple[Step, ...]:
    """One step per slot of ``pending`` (slots still to restore), wanted snapshots first (see the module).

    ``wanted``: files held requests wait for, in the order first wanted; ``snapshots``: every committed
    snapshot; ``done``: files this round has restored already.
    """
    by_file = {snap.file: snap for snap in snapshots}
    own: dict[int, list[manifest.Manifest]] = {}
    for snap in manifest.newest_first(snapshots):
        own.setdefault(snap.slot, []).append(snap)
    free = list(dict.fromkeys(pending))
    taken = set(done)
    first: list[Step] = []
    wants = [by_file[file] for file in dict.fromkeys(wanted) if file in by_file and file not in taken]
    for i, snap in enumerate(wants):
        later = {other.slot for other in wants[i + 1 :]}
        slot = snap.slot if snap.slot in free else next((s for s in free if s not in later), None)
        if slot is None:
            continue  # more wants than slots: this one waits for the round, then for a swap
        free.remove(slot)
        taken.add(snap.file)
        first.append(Step(slot, (snap,), wanted=snap.file))
    displaced = [group[0] for step in first if (group := own.get(step.slot)) and group[0].file not in taken]
    rest: list[Step] = []
    for slot in free:
        candidates = tuple(snap for snap in own.get(slot, ()) if snap.file not in taken)
        if not candidates and displaced:
            candidates = (displaced.pop(0),)
        taken.update(snap.file for snap in candidates[:1])
        rest.append(Step(slot, candidates))
    fallbacks = tuple(
        dataclasses.replace(step, candidates=step.candidates + _others(own.get(step.slot, ()), taken)) for step in first
    )
    return fallbacks + tuple(rest)


def _others(group: Sequence[manifest.Manifest], taken: Collection[str]) -> tuple[manifest.Manifest, ...]:
    """The slot's own snapshots no step restores, newest first: tried if the wanted one fails its check."""
    return tuple(snap for snap in group if snap.file not in taken)


@dataclasses.dataclass(frozen=True, slots=True)
class RestorePlan:
    slot: int
    candidates: tuple[manifest.Manifest, ...]
    """Compatible snapshots, newest first; try the next one if a file fails its check."""
    outcome: outcomes.RestoreOutcome | None
    """Set when there is nothing to try: why."""
    refusals: tuple[tuple[str, str], ...] = ()
    """(file, why) of each snapshot refused as incompatible."""


def plan_restore(
    view: events.SlotView,
    snapshots: Sequence[manifest.Manifest],
    identity: events.Identity,
    *,
    in_order: bool = False,
) -> RestorePlan:
    """What to restore into ``view``: never into a busy slot or one holding tokens.

    ``in_order``: ``snapshots`` are already in the order to try them (a restore round's plan); else newest first.
    """
    if view.processing or not view.empty:
        return RestorePlan(view.id, (), outcomes.RestoreOutcome.SLOT_BUSY)
    if not snapshots:
        return RestorePlan(view.id, (), outcomes.RestoreOutcome.NO_SNAPSHOT)
    good: list[manifest.Manifest] = []
    refusals: list[tuple[str, str]] = []
    for snap in snapshots if in_order else manifest.newest_first(snapshots):
        problems = manifest.incompatibilities(snap, identity, slot_n_ctx=view.n_ctx)
        if problems:
            refusals.append((snap.file, "; ".join(problems)))
        else:
            good.append(snap)
    outcome = None if good else outcomes.RestoreOutcome.INCOMPATIBLE
    return RestorePlan(view.id, tuple(good), outcome, tuple(refusals))
