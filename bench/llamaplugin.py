"""The pytest plugin the CI test of llama.cpp's server tests runs them with, instead of the suite's conftest.py.

The suite's conftest.py does two things: it starts and stops every preset once to download its model
(``ServerPreset.load_all``), which the mapping to the local model makes moot, and it stops every server
a test started after it. A dozen servers started twice each way take most of CI's budget, so the CI
test runs with ``--noconftest`` and this plugin doing the second part; ``python -m bench.llamatests``
keeps the suite's own conftest.py.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest

sys.path.insert(0, os.getcwd())  # the suite's folder: its tests import its utils.py


@pytest.fixture(autouse=True)
def stop_server_after_each_test() -> Iterator[None]:
    yield
    utils = importlib.import_module("utils")  # the suite's own module, on the path once its folder is
    started: set[Any] = set(utils.server_instances)
    for server in started:
        server.stop()
