"""Lines for the end of the pytest run, shown whatever the output capture."""

from __future__ import annotations

import pytest

SUMMARY = pytest.StashKey[list[str]]()
"""Lines printed in the "measured" section of pytest's terminal summary (see tests/conftest.py)."""
