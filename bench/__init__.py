"""Benchmarks of llama-kv-sidecar against a real llama-server and a real model.

Run ``python -m bench`` from the repository's root (``--quick`` for a short pass). It prints
tables, writes a PNG and a JSON of raw results, and one verdict line per goal; it exits
non-zero when a goal is missed. The llama-server process control and HTTP helpers are the
test beds' (the package ``tests.support``).
"""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
