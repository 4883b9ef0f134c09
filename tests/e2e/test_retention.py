"""Retention against the real server: --keep-per-slot (per conversation), --max-bytes and --max-age delete files."""

from __future__ import annotations

import time
from pathlib import Path

from tests.support.llamabed import MakeServer, complete, make_prompt
from tests.support.sidecarbed import MakeSidecar, SidecarProcess, bin_of, manifests
from tests.support.wait import wait_until

TOKENS = 512


def _files(slot_dir: Path) -> list[str]:
    return sorted(p.name for p in slot_dir.iterdir() if p.name.startswith("slot"))


def _turn(server_url: str, convo: list[str], seed: int) -> None:
    """One more turn of the same conversation: the slot changes, the sidecar saves it again."""
    convo.append(make_prompt(server_url, 100, seed=seed))
    complete(server_url, " ".join(convo))


def _deleted(side: SidecarProcess, reason: str) -> float:
    return side.metric("llama_sidecar_gc_deleted_total", reason=reason)


def test_keep_per_slot_and_max_bytes_delete_the_oldest_files_and_count_them(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    server = llama(slot_dir=slot_dir)
    convo = [make_prompt(server.url, TOKENS, seed=71)]
    side = sidecar(server, slot_dir, extra={"--keep-per-slot": "2"})
    complete(server.url, convo[0])
    side.wait_saved()
    for n in (2, 3):
        _turn(server.url, convo, seed=71 + n)
        side.wait_saved(n)
    # The garbage collection runs after the commit that made the first turn superseded, and counts a
    # deletion once both files are gone: waited for, not read at once.
    side.wait_for(lambda: _deleted(side, "superseded") >= 1, timeout=10, what="the first turn's deletion")
    committed = [e["file"] for e in side.log_events("snapshot_committed")]
    assert manifests(slot_dir) == [f.replace(".bin", ".json") for f in committed[1:]]
    assert _files(slot_dir) == sorted([*committed[1:], *(f.replace(".bin", ".json") for f in committed[1:])])
    assert _deleted(side, "superseded") == 1  # the first turn: a prefix of the two newer snapshots
    assert [e["file"] for e in side.log_events("snapshot_deleted")] == [committed[0]]
    side.terminate()

    # A byte cap that holds one snapshot and a half: each new one pushes the older out.
    newest = slot_dir / committed[-1]
    cap = newest.stat().st_size + newest.stat().st_size // 2
    side = sidecar(server, slot_dir, extra={"--keep-per-slot": "5", "--max-bytes": str(cap)})
    _turn(server.url, convo, seed=80)
    side.wait_saved()
    side.wait_for(lambda: _deleted(side, "bytes") >= 2, timeout=10, what="both older snapshots deleted")
    assert _deleted(side, "bytes") == 2
    (kept,) = manifests(slot_dir)
    assert side.log_events("snapshot_committed")[0]["file"] == bin_of(kept)
    assert sum((slot_dir / f).stat().st_size for f in _files(slot_dir) if f.endswith(".bin")) <= cap


def test_max_age_deletes_an_expired_snapshot_after_a_save(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    server = llama(slot_dir=slot_dir)
    convo = [make_prompt(server.url, TOKENS, seed=81)]
    side = sidecar(server, slot_dir, extra={"--keep-per-slot": "5", "--max-age": "2"})
    complete(server.url, convo[0])
    side.wait_saved()
    (old,) = manifests(slot_dir)
    created = (slot_dir / old).stat().st_mtime
    side.wait_for(lambda: time.time() - created > 2.5, what="the first snapshot to pass --max-age")
    _turn(server.url, convo, seed=82)
    side.wait_saved(2)
    side.wait_for(lambda: _deleted(side, "age") == 1, timeout=10, what="the expired snapshot to be deleted")
    assert old not in manifests(slot_dir)
    assert not (slot_dir / bin_of(old)).exists()
    assert len(manifests(slot_dir)) == 1  # the newest is kept, however old it gets


def test_max_age_deletes_an_expired_snapshot_while_the_server_is_idle(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path
) -> None:
    """Two snapshots of a slot, then no more traffic: once the older passes --max-age it must go."""
    server = llama(slot_dir=slot_dir)
    convo = [make_prompt(server.url, TOKENS, seed=91)]
    side = sidecar(server, slot_dir, extra={"--keep-per-slot": "5"})
    complete(server.url, convo[0])
    side.wait_saved()
    _turn(server.url, convo, seed=92)
    side.wait_saved(2)
    side.terminate()
    older, newest = manifests(slot_dir)
    created = (slot_dir / older).stat().st_mtime
    wait_until(lambda: time.time() - created > 4, timeout=10, what="the older snapshot to be 4 s old")
    # A sidecar with --max-age 3 and a server that stays idle: no save will come to trigger a clean-up.
    side = sidecar(server, slot_dir, extra={"--keep-per-slot": "5", "--max-age": "3"})
    side.wait_for(lambda: side.log_events("slot_already_saved"), what="the newest snapshot adopted")
    side.wait_for(
        lambda: _deleted(side, "age") == 1,
        timeout=20,
        what="the expired snapshot to be deleted by --max-age 3 on an idle server",
    )
    assert manifests(slot_dir) == [newest]
    assert not (slot_dir / bin_of(older)).exists()
