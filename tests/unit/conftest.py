"""Fixtures of the unit tests: fast, no real llama-server, no network beyond loopback."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import configuration

# Hypothesis caches constants it finds in the code under test; keep that out of the work tree.
configuration.set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "llama-kv-sidecar-hypothesis")
