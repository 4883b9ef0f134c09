"""Saves that lie or die half-way are never promoted to snapshots.

The fake's save of slot 0 misbehaves after one good snapshot of it exists:
the file is truncated while the reply claims the full ``n_written``, the file
is missing while the reply claims success, the server writes half a file and
answers 500 (a crash mid-save, seen from the sidecar), or the reply lacks
``n_written``. Each time: no manifest, the temp file gone, one
``snapshots_total{result="failed"}``, a log line saying why, and the good
snapshot still on disk, indexed, and the one restored after a restart.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import xxhash

from tests.support.fakellama import Action, FakeLlama, Reply, SaveFault, SaveKind
from tests.support.faultbed import make_settings, run_sidecar
from tests.support.wait import eventually, until

CASES = [
    pytest.param(SaveKind.TRUNCATE, "bytes but the server reported writing", id="truncated-file"),
    pytest.param(SaveKind.NOTHING, "--slot-dir must be the same directory", id="missing-file"),
    pytest.param(SaveKind.HALF_THEN_500, "HTTP 500", id="half-file-then-500"),
    pytest.param(SaveKind.BAD_REPLY, "'n_saved'", id="reply-without-n_written"),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("kind", "says"), CASES)
async def test_bad_save_is_never_promoted(fake: FakeLlama, slot_dir: Path, kind: SaveKind, says: str) -> None:
    fake.use(0, 300)  # slot 1 stays empty: the sidecar's slot-dir probe goes there
    async with run_sidecar(make_settings(fake.url, slot_dir)) as car:
        await eventually(lambda: car.metric("snapshots_total", slot="0", result="ok"), what="first snapshot")
        good = sorted(p.name for p in slot_dir.iterdir() if not p.name.startswith(".llama-kv-sidecar"))
        assert len(good) == 2, good  # slot0-<stamp>.bin and its .json
        good_bin = next(name for name in good if name.endswith(".bin"))
        good_digest = xxhash.xxh3_128_hexdigest((slot_dir / good_bin).read_bytes())
        saves_before = len(fake.saves)

        fake.save_fault = SaveFault(kind, slot=0)
        fake.use(0, 400)
        await eventually(
            lambda: car.metric("snapshots_total", slot="0", result="failed"), what="the failed save to be counted"
        )

        attempt = fake.saves[saves_before]
        assert attempt.slot == 0
        assert attempt.filename.startswith(".tmp-"), "the server must write to a temp name, never a final one"
        assert sorted(p.name for p in slot_dir.iterdir() if not p.name.startswith(".llama-kv-sidecar")) == good, (
            "temp file left behind or a manifest written"
        )
        assert await car.metric("snapshots_total", slot="0", result="ok") == 1
        assert await car.metric("snapshots_total", slot="0", result="failed") == 1

        failed = car.events("snapshot_failed")
        assert len(failed) == 1, failed
        assert failed[0]["slot"] == 0
        assert says in failed[0]["error"], failed[0]

        status = await car.status()
        assert [s["file"] for s in status["snapshots"]["0"]] == [good_bin]
        assert status["last_snapshot"]["result"] == "failed"
        await eventually(lambda: car.metric("snapshot_files"), what="snapshot_files gauge")
        assert await car.metric("snapshot_files") == 1
        assert xxhash.xxh3_128_hexdigest((slot_dir / good_bin).read_bytes()) == good_digest
        manifest = json.loads((slot_dir / good_bin.replace(".bin", ".json")).read_text())
        assert manifest["checksum"] == {"algorithm": "xxh3-128", "digest": good_digest}
        if kind is SaveKind.NOTHING:
            code, body = await car.get("/readyz")
            assert code == 503
            assert "--slot-dir" in body

        # The good snapshot is the one a restarted server gets back.
        fake.save_fault = None
        fake.restart()
        await until(lambda: fake.restores, what="a restore after the restart")
        assert fake.restores == [Action(0, good_bin)]
        await eventually(lambda: car.metric("restores_total", slot="0", result="ok"), what="restore counted")
        assert car.alive()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("reply", "says"),
    [
        pytest.param(Reply.raw('{"id_slot": 0, "n_rest'), "JSON", id="bad-json"),
        pytest.param(Reply.json({"id_slot": 0, "n_restored": "300", "n_read": 19244}), "'n_restored'", id="str"),
        pytest.param(Reply.error(500), "HTTP 500", id="500"),
    ],
)
async def test_bad_restore_reply_is_a_failed_restore(fake: FakeLlama, slot_dir: Path, reply: Reply, says: str) -> None:
    fake.use(0, 300)
    # The second restart changes nothing but the process start time (slot 0 stays empty).
    async with run_sidecar(make_settings(fake.url, slot_dir)) as car:
        await eventually(lambda: car.metric("snapshots_total", slot="0", result="ok"), what="first snapshot")
        good = [s["file"] for s in (await car.status())["snapshots"]["0"]]

        fake.replies["restore"] = reply
        fake.restart()
        await eventually(lambda: car.metric("restores_total", slot="0", result="failed"), what="a failed restore")
        failed = car.events("restore_failed")
        assert len(failed) == 1, failed
        assert failed[0]["error"].startswith("/slots"), failed[0]
        assert says in failed[0]["error"], failed[0]
        assert car.alive()
        assert await car.metric("restores_total", slot="0", result="ok") == 0
        assert [s["file"] for s in (await car.status())["snapshots"]["0"]] == good, "a server-side failure dropped it"

        fake.replies.clear()
        fake.restart()
        await eventually(lambda: car.metric("restores_total", slot="0", result="ok"), what="a restore once it answers")
        assert fake.restores[-1] == Action(0, good[0])
