"""Fixtures and report hooks shared by every test folder."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from support.report import SUMMARY


def pytest_configure(config: pytest.Config) -> None:
    config.stash[SUMMARY] = []


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """Print the figures the tests measured (quoted by the docs) and the llama-server build, whatever the capture."""
    lines = config.stash.get(SUMMARY, [])
    if lines:
        terminalreporter.section("measured")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture
def figure(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """`figure("...")` records one line for the end-of-run "measured" section."""
    lines = request.config.stash[SUMMARY]
    name = request.node.name

    def record(text: str) -> None:
        lines.append(f"{name}: {text}")

    return record


@pytest.fixture(autouse=True)
def clean_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hide the caller's LLAMA_* variables: the CLI reads them as defaults."""
    for name in list(os.environ):
        if name.startswith("LLAMA_"):
            monkeypatch.delenv(name)


@pytest.fixture
def slot_dir(tmp_path: Path) -> Path:
    """An empty directory for `--slot-save-path` / `--slot-dir`."""
    path = tmp_path / "slots"
    path.mkdir()
    return path
