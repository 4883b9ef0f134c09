"""Hostile files in the slot dir, against the real server: refused by what they are, never hashed, read or restored.

Each case puts one file beside a good snapshot while the sidecar runs: a
``.bin`` linked to ``/dev/zero`` with a manifest of 0 bytes, a FIFO named like
a manifest, a ``.bin`` linked to a file outside the dir with a consistent
manifest, a manifest of a gigabyte. The sidecar says what it refused and why,
keeps saving, restores the good snapshot after a ``kill -9`` of the server,
and ends on SIGTERM within ``--final-timeout`` plus its margin.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import xxhash

from sidecar.app import signals
from tests.support.llamabed import MakeServer, complete, make_prompt
from tests.support.sidecarbed import MakeSidecar, bin_of, manifests

TOKENS = 512
FINAL_TIMEOUT = 5.0
HOSTILE = "slot0-20991231T235959000000Z"
"""A name newer than any real snapshot's, with the highest generation: the first a restore would try."""


def _manifest_like(good: dict[str, object], *, size: int, digest: str) -> str:
    body = dict(good)
    body.update(file=HOSTILE + ".bin", bytes=size, generation=10**6, index=None)
    body["checksum"] = {"algorithm": "xxh3-128", "digest": digest}
    return json.dumps(body)


def _plant(kind: str, slot_dir: Path, outside: Path) -> str:
    """Put the hostile file(s) of ``kind`` in the slot dir (the .bin first, the manifest last, as a commit does)."""
    (good_json,) = manifests(slot_dir)
    good = json.loads((slot_dir / good_json).read_text())
    good_bin = slot_dir / bin_of(good_json)
    bin_path, json_path = slot_dir / (HOSTILE + ".bin"), slot_dir / (HOSTILE + ".json")
    if kind == "dev_zero":
        bin_path.symlink_to("/dev/zero")
        json_path.write_text(_manifest_like(good, size=0, digest=xxhash.xxh3_128_hexdigest(b"")))
        return "not_regular"
    if kind == "outside_link":
        shutil.copyfile(good_bin, outside)  # a file llama-server would restore, outside the slot dir
        bin_path.symlink_to(outside)
        digest = xxhash.xxh3_128_hexdigest(outside.read_bytes())
        json_path.write_text(_manifest_like(good, size=outside.stat().st_size, digest=digest))
        return "not_regular"
    shutil.copyfile(good_bin, bin_path)
    if kind == "fifo":
        os.mkfifo(json_path)
        return "not_regular"
    with json_path.open("wb") as fh:
        fh.truncate(1 << 30)  # a manifest of a gigabyte (sparse)
    return "oversized"


def _peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM in /proc/<pid>/status")


@pytest.mark.parametrize("kind", ["dev_zero", "fifo", "outside_link", "huge_manifest"])
def test_a_hostile_file_is_refused_and_the_sidecar_keeps_saving_restoring_and_stops_in_time(
    llama: MakeServer,
    sidecar: MakeSidecar,
    slot_dir: Path,
    tmp_path: Path,
    kind: str,
    figure: Callable[[str], None],
) -> None:
    server = llama(slot_dir=slot_dir)
    side = sidecar(server, slot_dir, extra={"--final-timeout": str(FINAL_TIMEOUT)})
    assert side.proc is not None
    prompt = make_prompt(server.url, TOKENS, seed=91)
    complete(server.url, prompt)
    side.wait_saved()

    reason = _plant(kind, slot_dir, tmp_path / "outside.bin")
    side.wait_for(
        lambda: side.metric("llama_sidecar_snapshots_quarantined_total", reason=reason) == 1,
        timeout=30,
        what=f"the {kind} file refused as {reason}",
    )
    (said,) = [e for e in side.log_events("snapshot_quarantined") if e["file"] == HOSTILE + ".bin"]
    assert said["reason"] == reason
    assert said["effect"]
    assert said["hint"]

    complete(server.url, prompt + " and one more turn of the same conversation")
    side.wait_saved(2)  # it keeps saving

    server.kill()
    server.start()
    server.wait_healthy()
    side.wait_restored(timeout=60)  # the good snapshot, not the hostile one
    (restored,) = side.log_events("slot_restored")
    assert restored["file"] != HOSTILE + ".bin"
    warm = complete(server.url, prompt + " and one more turn of the same conversation, continued")
    assert warm["timings"]["cache_n"] >= 0.9 * TOKENS
    if kind == "outside_link":
        assert (tmp_path / "outside.bin").exists()  # untouched, and never handed to the server
    peak = _peak_rss_kib(side.proc.pid)

    started = time.monotonic()
    code = side.terminate(timeout=60)
    stopped_in = time.monotonic() - started
    figure(
        f"{kind}: refused as {reason}, good snapshot restored (cache_n {warm['timings']['cache_n']} of "
        f"{warm['timings']['cache_n'] + warm['timings']['prompt_n']}), sidecar peak RSS {peak // 1024} MiB, "
        f"SIGTERM to exit {stopped_in:.2f} s (exit {code})"
    )
    assert code == 0
    assert stopped_in < FINAL_TIMEOUT + signals.EXIT_MARGIN
    assert peak < 256 << 10  # the gigabyte manifest was never read
