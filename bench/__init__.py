"""Benchmarks of llama-kv-sidecar against a real llama-server and a real model.

Run ``python -m bench`` (``--quick`` for a short pass). It prints tables and
writes a PNG and a JSON of raw results; it asserts nothing. The llama-server
process control and HTTP helpers are the e2e test bed's (``tests/e2e``),
imported by bare name, so that directory goes on ``sys.path`` here, before
any benchmark module imports ``llamabed`` or ``sidecarbed``.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
_BEDS = str(REPO_ROOT / "tests" / "e2e")
if _BEDS not in sys.path:
    sys.path.insert(0, _BEDS)
