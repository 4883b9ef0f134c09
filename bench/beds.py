"""The test beds of the package `tests.support`, as the benchmarks use them."""

from __future__ import annotations

from tests.support import (
    haproxybed,
    llamabed,
    net,
    nodechats,
    s3bed,
    sharednodes,
    sidecarbed,
    tinymodels,
    wait,
    widekv,
    widekvswa,
)

__all__ = [
    "haproxybed",
    "llamabed",
    "net",
    "nodechats",
    "s3bed",
    "sharednodes",
    "sidecarbed",
    "tinymodels",
    "wait",
    "widekv",
    "widekvswa",
]
