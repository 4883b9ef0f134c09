"""A ``kill -9`` in the middle of a real ingest: no recipe names a missing block, collection cleans up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from sidecar.blocks import blockdir, collect, store
from tests.support import clocks, slotfiles
from tests.support.wait import wait_until

INGEST = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from sidecar.blocks import store
    from sidecar.core import protocols
    s = store.BlockStore(Path(sys.argv[1]), clock=protocols.SystemClock(), tokens=16)
    s.ingest("big", Path(sys.argv[2]))
    """
)


def test_kill_9_mid_ingest_then_collection_keeps_every_committed_recipe_whole(tmp_path: Path) -> None:
    root = tmp_path / "store"
    s = store.BlockStore(root, clock=clocks.reading(lambda: 1.0), tokens=16)
    small = slotfiles.slot_file(list(range(40)), slotfiles.Shape())
    (tmp_path / "small.bin").write_bytes(small)
    s.ingest("small", tmp_path / "small.bin")
    committed = set(blockdir_digests(root))
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(96 << 20))  # ~1,500 chunks, each written and fdatasync'ed: seconds of work

    proc = subprocess.Popen([sys.executable, "-c", INGEST, str(root), str(big)])
    try:
        wait_until(
            lambda: len(blockdir_digests(root)) >= len(committed) + 20,
            timeout=60,
            what="the ingest to have written 20 blocks",
            gone=lambda: None if proc.poll() is None else f"the ingest exited ({proc.returncode})",
        )
        assert proc.poll() is None, "the ingest finished before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL

    assert s.names() == ["small"]  # the dead ingest committed nothing
    orphans = set(blockdir_digests(root)) - committed
    assert orphans
    done = s.collect(wait=False)  # the dead process's lock went with it

    assert done.outcome is collect.Outcome.DONE
    assert done.blocks_deleted == len(orphans)
    assert set(blockdir_digests(root)) == committed
    assert not [p for p in root.rglob(".tmp-*")]
    s.reassemble("small", tmp_path / "small.out")
    assert (tmp_path / "small.out").read_bytes() == small


def blockdir_digests(root: Path) -> list[str]:
    return [d for d, _, _ in blockdir.BlockDir(root / "blocks").entries() if d]
