"""The e2e test bed's modules, as the benchmarks import them.

`tests/e2e` is an import root of its own (its helpers import each other by
bare name); `bench/__init__.py` puts it on `sys.path`. The repository's lint
runs mypy with `MYPYPATH=tests/e2e`, which types these modules fully; a bare
`mypy bench` cannot see them and treats them as untyped instead of failing.
"""

from __future__ import annotations

import llamabed  # type: ignore[import-not-found, unused-ignore]
import sidecarbed  # type: ignore[import-not-found, unused-ignore]

__all__ = ["llamabed", "sidecarbed"]
