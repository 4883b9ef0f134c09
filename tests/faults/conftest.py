"""Fixtures of the fault tests: a fake llama-server on a loopback port."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.fakellama import FakeLlama, MakeFake


@pytest.fixture
def make_fake(slot_dir: Path) -> Iterator[MakeFake]:
    """Start fakes with the given options (``n_slots``, ``api_key``...); all are stopped at teardown."""
    started: list[FakeLlama] = []

    def make(**options: object) -> FakeLlama:
        server = FakeLlama(slot_dir, **options).start()  # type: ignore[arg-type]
        started.append(server)
        return server

    try:
        yield make
    finally:
        for server in started:
            server.stop()


@pytest.fixture
def fake(make_fake: MakeFake) -> FakeLlama:
    return make_fake()
