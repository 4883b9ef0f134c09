"""Locating and running the external tools that check the deployment files.

A missing tool fails the test that needs it, with the command that installs
it; nothing is skipped. `deploy/check-tools.sh` installs all of them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
GRAFANA = REPO / "grafana"
CHECK_TOOLS = "bash deploy/check-tools.sh"


def require_tool(name: str, *, install: str) -> str:
    """The path of executable `name`, or a test failure saying how to install it.

    The directory of the running interpreter is searched first, so that tools
    installed with pip into the test environment are found even when that
    environment is not activated.
    """
    search = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    found = shutil.which(name, path=search)
    if found is None:
        pytest.fail(
            f"{name} is not installed: {install} (or run `{CHECK_TOOLS}`, which installs every tool these tests use)",
            pytrace=False,
        )
    return found


def run(
    cmd: list[str],
    *,
    cwd: Path = REPO,
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run `cmd`; a non-zero exit fails the test with the command and its output."""
    proc = subprocess.run(
        cmd,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )
    if proc.returncode != 0:
        pytest.fail(
            f"`{' '.join(cmd)}` (in {cwd.relative_to(REPO) if cwd.is_relative_to(REPO) else cwd}) "
            f"exited {proc.returncode}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}",
            pytrace=False,
        )
    return proc
