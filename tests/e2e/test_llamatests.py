"""llama.cpp's own server tests end the same through the sidecar as direct: the files that fit CI's budget.

The whole suite runs with ``python -m bench.llamatests`` (docs/proxy.md); here the upstream tests of
what the proxy answers itself or passes on (CORS, API keys, public endpoints, tokenizing), run
both ways against the real llama-server with the local model, every test id's outcome compared.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import llamatests

FILES = ["unit/test_security.py"]
"""The upstream test file run here: CORS, API keys and public endpoints, what the proxy answers or passes on."""
KEYWORD = "(cors and not cors_proxy) or public_endpoint or incorrect_api_key"
"""Its tests that generate nothing (a server start each, and a few requests): the CI budget."""


@pytest.mark.timeout(900)
def test_llama_cpps_server_tests_end_the_same_through_the_sidecar(tmp_path: Path) -> None:
    tests = llamatests.sources()
    server, model = llamatests.server_and_model()
    found = {}
    for mode in ("direct", "sidecar"):
        found[mode] = llamatests.run(
            mode, tests, FILES, tmp_path, server=server, model=model, keyword=KEYWORD, preload=False
        )
    assert len(found["direct"]) >= 15, f"the suite ran too few tests: {found['direct']}\n{_tail(tmp_path)}"
    passed = [t for t, outcome in found["direct"].items() if outcome == "passed"]
    assert len(passed) >= 15, f"direct, too few passed: {found['direct']}"
    bad, _ = llamatests.compare(found["direct"], found["sidecar"], llamatests.ALLOWED)
    assert not bad, "\n".join(bad) + "\n" + _tail(tmp_path)


def _tail(work: Path) -> str:
    log = work / "sidecar.log"
    return log.read_text(errors="replace")[-4000:] if log.exists() else ""
