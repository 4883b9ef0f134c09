"""Benchmarks of llama-kv-sidecar against a real llama-server and a real model.

Run ``python -m bench`` (``--quick`` for a short pass). It prints tables and
writes a PNG and a JSON of raw results, and one verdict line per goal; it exits
non-zero when a goal is missed. The llama-server process control and HTTP
helpers are the test beds' (``tests/support``, imported as ``support``), so
``tests/`` goes on ``sys.path`` here, before any benchmark module imports them.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
_BEDS = str(REPO_ROOT / "tests")
if _BEDS not in sys.path:
    sys.path.insert(0, _BEDS)
