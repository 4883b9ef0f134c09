"""Fixtures of the fault tests: a fake llama-server on a loopback port, and a slot dir."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakellama import FakeLlama, MakeFake


@pytest.fixture(autouse=True)
def _clean_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hide the caller's LLAMA_* variables: the CLI reads them as defaults."""
    for name in list(os.environ):
        if name.startswith("LLAMA_"):
            monkeypatch.delenv(name)


@pytest.fixture
def slot_dir(tmp_path: Path) -> Path:
    path = tmp_path / "slots"
    path.mkdir()
    return path


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
