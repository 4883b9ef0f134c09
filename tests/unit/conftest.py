"""Fixtures of the unit tests: fast, no real llama-server, no network beyond loopback."""

from __future__ import annotations

import os
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from hypothesis import configuration

from sidecar.core import hashing, location
from sidecar.shared import connect, objstore

# Hypothesis caches constants it finds in the code under test; keep that out of the work tree.
configuration.set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "llama-kv-sidecar-hypothesis")


@pytest.fixture
def hash_pauses(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The ``pause`` of every commit's hash (``hashing.digest_and_sync``), in order; the hash still runs."""
    pauses: list[float] = []
    digest = hashing.digest_and_sync

    def watched(
        path: Path,
        algorithm: hashing.Algorithm = hashing.CURRENT,
        *,
        pause: float = 0.0,
        limit: int | None = None,
        mode: int | None = None,
        same_as: os.stat_result | None = None,
    ) -> str:
        pauses.append(pause)
        return digest(path, algorithm, pause=pause, limit=limit, mode=mode, same_as=same_as)

    monkeypatch.setattr(hashing, "digest_and_sync", watched)
    return pauses


@pytest.fixture(params=["s3", "file"])
async def objects(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[objstore.ObjectStore]:
    """An object store of each kind: a real S3 server (SeaweedFS) and a directory."""
    if request.param == "s3":
        url = request.getfixturevalue("s3_url")
    else:
        (tmp_path / "shared").mkdir()
        url = f"file://{tmp_path / 'shared'}"
    opened = connect.open_store(location.parse(url, os.environ))
    yield opened
    await opened.close()
