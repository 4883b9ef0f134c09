"""Whether llama-server runs with ``--swa-full``, from its command line (``/proc``), when it runs on this host.

Neither ``/props`` nor a slot file says it (a windowed layer's cells in a
slot file are the window's with and without the flag: ``state_write`` drops
the masked ones in both cases). The process that listens on the upstream's
port is found among this host's processes (the same user's, or any readable):
its arguments, and llama.cpp's ``LLAMA_ARG_SWA_FULL`` in its environment.
Nothing found (another host, another container, unreadable): None, and the
sidecar does what works either way.

Invariants and trade-offs: docs/modules.md, `sidecar/observe/serverargs.py`.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterable, Sequence
from pathlib import Path

DEFAULT_PORT = 8080
"""llama-server's ``--port`` when none is given."""
TRUE = frozenset({"1", "true", "on", "enabled", "yes"})
"""Values llama.cpp's ``LLAMA_ARG_*`` environment switches take as on."""


def port_of(url: str) -> int | None:
    """The TCP port of the upstream ``url``; None for a URL without a host (a socket path, a typo)."""
    parsed = urllib.parse.urlsplit(url)
    if not parsed.hostname:
        return None
    try:
        return parsed.port or (443 if parsed.scheme == "https" else 80)
    except ValueError:
        return None


def listens_on(argv: Sequence[str], environ: dict[str, str], port: int) -> bool:
    """Whether a llama-server started with ``argv`` and ``environ`` listens on ``port``. Pure."""
    if not argv or "llama-server" not in Path(argv[0]).name:
        return False
    given: str | None = environ.get("LLAMA_ARG_PORT")
    for i, arg in enumerate(argv):
        if arg == "--port" and i + 1 < len(argv):
            given = argv[i + 1]
        elif arg.startswith("--port="):
            given = arg.split("=", 1)[1]
    try:
        return (int(given) if given is not None else DEFAULT_PORT) == port
    except ValueError:
        return False


def swa_full(argv: Sequence[str], environ: dict[str, str]) -> bool:
    """Whether a llama-server started with ``argv`` and ``environ`` keeps every position of windowed layers. Pure."""
    if "--swa-full" in argv:
        return True
    return environ.get("LLAMA_ARG_SWA_FULL", "").strip().lower() in TRUE


def _processes(root: Path) -> Iterable[tuple[list[str], dict[str, str]]]:
    for entry in root.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = [a.decode(errors="replace") for a in (entry / "cmdline").read_bytes().split(b"\0") if a]
        except OSError:
            continue
        if not argv or "llama-server" not in Path(argv[0]).name:
            continue
        environ: dict[str, str] = {}
        try:
            for item in (entry / "environ").read_bytes().split(b"\0"):
                key, _, value = item.decode(errors="replace").partition("=")
                if key.startswith("LLAMA_ARG_"):
                    environ[key] = value
        except OSError:
            pass
        yield argv, environ


def swa_full_at(url: str, *, root: Path = Path("/proc")) -> bool | None:
    """Whether the llama-server this host runs on ``url``'s port has ``--swa-full``; None: not found here.

    Blocking (reads ``/proc``): run it in a thread.
    """
    port = port_of(url)
    if port is None or not root.is_dir():
        return None
    found = [swa_full(argv, env) for argv, env in _processes(root) if listens_on(argv, env, port)]
    if len(found) != 1:
        return None  # none, or several on one port (other network namespaces): nothing to tell them apart
    return found[0]
