"""A flood of malformed requests makes one log line and a count, not a line (and a traceback) each."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from sidecar.core import logfold
from tests.support.fakellama import FakeLlama
from tests.support.proxybed import raw_exchange
from tests.support.sidecarbed import SidecarProcess

MALFORMED = b"GET /healthz HTTP/1.1\r\nHost: a\r\nBad Header\r\n\r\n"
SENT = 300


@pytest.mark.timeout(90)
async def test_a_flood_of_malformed_requests_is_one_line_and_a_count(
    fake: FakeLlama, slot_dir: Path, tmp_path: Path
) -> None:
    proc = SidecarProcess(fake.url, slot_dir, tmp_path / "log").start()
    try:
        started = time.monotonic()
        for _ in range(SENT):
            answer = await raw_exchange(proc.port, MALFORMED, timeout=5.0)
            assert answer.split(b" ", 2)[1] == b"400", answer[:80]
        elapsed = time.monotonic() - started
    finally:
        assert proc.terminate() == 0, proc.tail()
    entries = proc.logs()
    failed = [e for e in entries if str(e.get("event", "")).startswith("Error handling request")]
    folded = [e for e in entries if e.get("event") == "log_lines_folded" and "Error handling request" in e["kind"]]
    assert len(failed) + sum(e["lines"] for e in folded) == SENT, (len(failed), folded)
    assert len(failed) <= 1 + int(elapsed / logfold.EVERY), f"{len(failed)} lines in {elapsed:.1f} s"
    assert sum(len(line) for line in proc.lines()) < 64 << 10, "the log of the flood stays small"
