"""Fixtures and report hooks shared by every test folder."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.report import SUMMARY
from tests.support.s3bed import S3Server

S3_BUCKET = "sidecar-tests"


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
def clean_environ(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Hide the caller's LLAMA_* variables: the CLI reads them as defaults. The default state dir is the
    test's own (``$XDG_STATE_HOME``): a launcher run keeps its block store there, never in the caller's home."""
    for name in list(os.environ):
        if name.startswith("LLAMA_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg-state"))


@pytest.fixture
def slot_dir(tmp_path: Path) -> Path:
    """An empty directory for `--slot-save-path` / `--slot-dir`."""
    path = tmp_path / "slots"
    path.mkdir()
    return path


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One real S3 server (SeaweedFS) for the whole session, with the bucket `sidecar-tests`."""
    server = S3Server(tmp_path_factory.mktemp("s3"))
    server.start()
    try:
        server.create_bucket(S3_BUCKET)
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_url(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """`s3://sidecar-tests/<fresh prefix>` with the AWS variables of the test server set; restarts it if stopped."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    yield f"s3://{S3_BUCKET}/t-{secrets.token_hex(4)}"
    s3_server.start()  # a test that took the store away gives it back to the next one
