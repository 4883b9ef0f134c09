"""Fixtures shared by the unit tests: fast, no real llama-server, no network beyond loopback."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import configuration

# Hypothesis caches constants it finds in the code under test; keep that out of the work tree.
configuration.set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "llama-kv-sidecar-hypothesis")


@pytest.fixture(autouse=True)
def clean_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hide the caller's LLAMA_* variables: the CLI reads them as defaults."""
    for name in list(os.environ):
        if name.startswith("LLAMA_"):
            monkeypatch.delenv(name)
