"""The test beds (`tests/support`), as the benchmarks import them.

`bench/__init__.py` puts `tests/` on `sys.path`. The repository's lint runs
mypy with `MYPYPATH=tests`, which types these modules fully; a bare
`mypy bench` cannot see them and treats them as untyped instead of failing.
"""

from __future__ import annotations

from support import haproxybed, llamabed, net, nodechats, s3bed, sharednodes, sidecarbed, tinymodels, wait, widekv  # type: ignore[import-not-found, unused-ignore]

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
]
