"""The environment of the processes the tests start."""

from __future__ import annotations

import os


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without `LLAMA_*`, plus `extra`.

    The sidecar's CLI reads `LLAMA_SIDECAR_*` and llama-server reads
    `LLAMA_ARG_*` as defaults: a developer's shell must not change what is tested.
    """
    return {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_")} | (extra or {})
