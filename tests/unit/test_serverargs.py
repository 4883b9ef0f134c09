"""Whether llama-server runs with --swa-full, from its command line: no reply and no slot file says it."""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.core import events
from sidecar.observe import memory, serverargs


@pytest.mark.parametrize(
    ("argv", "environ", "port", "listens"),
    [
        (["/opt/bin/llama-server", "-m", "m.gguf", "--port", "8081"], {}, 8081, True),
        (["llama-server", "--port=9000"], {}, 9000, True),
        (["llama-server", "-m", "m.gguf"], {}, 8080, True),  # the default port
        (["llama-server", "-m", "m.gguf"], {"LLAMA_ARG_PORT": "7000"}, 7000, True),
        (["llama-server", "--port", "8081"], {}, 8080, False),
        (["python", "-m", "sidecar", "--port", "8081"], {}, 8081, False),  # not llama-server
        (["llama-server", "--port", "x"], {}, 8080, False),
    ],
)
def test_the_server_on_a_port(argv: list[str], environ: dict[str, str], port: int, listens: bool) -> None:
    assert serverargs.listens_on(argv, environ, port) is listens


@pytest.mark.parametrize(
    ("argv", "environ", "full"),
    [
        (["llama-server", "--swa-full"], {}, True),
        (["llama-server"], {"LLAMA_ARG_SWA_FULL": "1"}, True),
        (["llama-server"], {"LLAMA_ARG_SWA_FULL": "true"}, True),
        (["llama-server"], {"LLAMA_ARG_SWA_FULL": "0"}, False),
        (["llama-server", "-m", "m.gguf"], {}, False),
    ],
)
def test_swa_full_from_arguments_or_environment(argv: list[str], environ: dict[str, str], full: bool) -> None:
    assert serverargs.swa_full(argv, environ) is full


def _proc(root: Path, pid: int, argv: list[str], environ: dict[str, str] | None = None) -> None:
    folder = root / str(pid)
    folder.mkdir()
    (folder / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (folder / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in (environ or {}).items()))


def test_the_process_on_the_upstreams_port_is_read(tmp_path: Path) -> None:
    _proc(tmp_path, 10, ["llama-server", "--port", "8081", "--swa-full"])
    _proc(tmp_path, 11, ["llama-server", "--port", "8082"])
    (tmp_path / "self").mkdir()
    assert serverargs.swa_full_at("http://127.0.0.1:8081", root=tmp_path) is True
    assert serverargs.swa_full_at("http://localhost:8082/", root=tmp_path) is False
    assert serverargs.swa_full_at("http://10.0.0.5:9999", root=tmp_path) is None  # another host: not here
    _proc(tmp_path, 12, ["llama-server", "--port", "8082", "--swa-full"])
    assert serverargs.swa_full_at("http://127.0.0.1:8082", root=tmp_path) is None  # two: cannot tell
    assert serverargs.swa_full_at("unix-socket", root=tmp_path) is None
    assert serverargs.swa_full_at("http://127.0.0.1:8081", root=tmp_path / "missing") is None


def test_a_sliding_window_model_on_a_server_with_swa_full_is_handled_as_attention() -> None:
    assert memory.with_server(events.Memory.SWA, True) is events.Memory.SWA_FULL
    assert memory.with_server(events.Memory.SWA, None) is events.Memory.SWA  # unknown: what works either way
    assert memory.with_server(events.Memory.ATTENTION, True) is events.Memory.ATTENTION
    assert memory.cuts_back(events.Memory.SWA_FULL)
    assert not memory.cuts_back(events.Memory.SWA)
