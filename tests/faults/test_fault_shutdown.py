"""SIGTERM while the final save outlives --final-timeout: the sidecar gives up on time and exits cleanly.

The real llama-server cannot be made to take seconds over one save on demand;
the fake sleeps inside the save call.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.support.fakellama import MakeFake, SaveFault, SaveKind
from tests.support.sidecarbed import SidecarProcess

FINAL = 1.5
SLOW_SAVE = 8.0


@pytest.mark.timeout(60)
def test_final_save_slower_than_the_final_timeout_is_given_up_on_time(
    make_fake: MakeFake, slot_dir: Path, tmp_path: Path
) -> None:
    fake = make_fake()
    proc = SidecarProcess(
        fake.url,
        slot_dir,
        tmp_path / "sidecar.log",
        extra={"--idle-seconds": "600", "--min-tokens": "10", "--final-timeout": str(FINAL)},
    )
    proc.start()
    try:
        proc.wait_for(lambda: proc.log_events("slot_dir_linked"), timeout=20, what="the slot dir probe")
        fake.save_fault = SaveFault(SaveKind.SLOW, slot=0, delay=SLOW_SAVE)
        fake.use(0, 300)
        proc.wait_for(
            lambda: (proc.status()["slots"] or [{}])[0].get("tokens") == 300, timeout=20, what="slot 0 seen changed"
        )
        started = time.monotonic()
        code = proc.terminate(timeout=30)
        took = time.monotonic() - started
    finally:
        proc.kill()
    assert code == 0, proc.tail()
    assert FINAL <= took < FINAL + 5, f"exited {took:.1f} s after SIGTERM with --final-timeout {FINAL}"
    assert len(proc.log_events("final_snapshot_timeout")) == 1
    assert [a for a in fake.saves if a.slot == 0], "the final save of slot 0 was never sent"
    assert list(slot_dir.glob("slot0-*.json")) == []  # nothing half-saved was published
