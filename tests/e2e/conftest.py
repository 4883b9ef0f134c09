"""Fixtures for tests against a real llama-server (marker: `e2e`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import agents, tinymodels
from tests.support.llamabed import LlamaServer, MakeServer, llama_server_binary, model_path
from tests.support.report import SUMMARY
from tests.support.sidecarbed import MakeSidecar, SidecarProcess


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test under tests/e2e with `e2e` (registered in pyproject.toml)."""
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(autouse=True)
def _agents_closed() -> Iterator[None]:
    """The SDK clients a test made are closed when it ends, not whenever the garbage collector gets to them."""
    yield
    agents.close_all()


@pytest.fixture(scope="session")
def llama_binary(pytestconfig: pytest.Config) -> Path:
    """The llama-server binary (built once per machine, then cached), of the pinned build."""
    binary, build = llama_server_binary()
    pytestconfig.stash[SUMMARY].append(f"llama-server: {binary} (build {build})")
    return binary


@pytest.fixture(scope="session")
def model() -> Path:
    """The gemma3-270m Q4_K_M model file."""
    return model_path()


@pytest.fixture(scope="session")
def tiny_models(model: Path) -> dict[tinymodels.Arch, Path]:
    """Tiny random-weight hybrid models, one per architecture (written once per machine, see tinymodels)."""
    return {arch: tinymodels.model(arch, tokenizer_from=model) for arch in tinymodels.Arch}


@pytest.fixture(scope="session")
def windowed_models(model: Path) -> dict[tinymodels.Windowed, Path]:
    """Tiny random-weight sliding-window models (gpt-oss), written once per machine (see tinymodels)."""
    return {arch: tinymodels.windowed(arch, tokenizer_from=model) for arch in tinymodels.Windowed}


@pytest.fixture
def llama(llama_binary: Path, model: Path, tmp_path: Path) -> Iterator[MakeServer]:
    """Factory: `make(slot_dir=..., n_slots=1, start=True, **kw)` -> a healthy server.

    Every server made is killed at teardown. `start=False` returns it unstarted.
    """
    made: list[LlamaServer] = []

    def make(slot_dir: Path | None = None, n_slots: int = 1, start: bool = True, **kw: Any) -> LlamaServer:
        kw.setdefault("log_dir", tmp_path)
        served = kw.pop("model", None) or model  # another model file (a tiny hybrid) instead of the test model
        server = LlamaServer(llama_binary, served, slot_dir=slot_dir, n_slots=n_slots, **kw)
        made.append(server)
        if start:
            server.start()
            server.wait_healthy()
        return server

    yield make
    for server in made:
        server.kill()


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[MakeSidecar]:
    """Factory: `make(server, slot_dir, extra={flag: value}, env={...})` -> a running sidecar."""
    made: list[SidecarProcess] = []

    def make(server: LlamaServer, slot_dir: Path, **kw: Any) -> SidecarProcess:
        proc = SidecarProcess(server.url, slot_dir, tmp_path / f"sidecar-{len(made)}.log", **kw)
        made.append(proc)
        return proc.start()

    yield make
    for proc in made:
        proc.kill()
