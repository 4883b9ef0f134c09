"""The command line the launcher gives llama-server: the user's arguments and what the sidecar needs. Pure code.

Invariants and trade-offs: docs/modules.md, `sidecar/launch/argv.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

from sidecar.core import errors

SLOT_SAVE_PATH = "--slot-save-path"
METRICS = "--metrics"
HOST = "--host"
PORT = "--port"
NO_SLOTS = "--no-slots"
API_KEYS = ("--api-key", "--api-key-file")
ROUTER = ("--models-dir", "--models-preset")
"""Router mode: llama-server serves several models (see ``--router``)."""
CACHE_RAM = ("--cache-ram", "-cram")
"""The size of llama-server's RAM prompt cache in MiB (-1: no limit, 0: none); the library routes below it."""
CACHE_RAM_UNLIMITED = 1 << 50
"""Bytes taken for ``--cache-ram -1``: more than any host holds."""
_WITH_VALUE = frozenset({SLOT_SAVE_PATH, HOST, PORT, *API_KEYS, *ROUTER, *CACHE_RAM})
LOCAL_HOST = "127.0.0.1"
SERVER_DEFAULT_PORT = 8080
"""llama-server's own default ``--port``."""
_WILDCARDS = {"": LOCAL_HOST, "0.0.0.0": LOCAL_HOST, "::": "::1", "[::]": "::1"}  # noqa: S104 (read, not bound)
"""Addresses that listen everywhere, and the loopback address the sidecar reaches them at."""


@dataclasses.dataclass(frozen=True, slots=True)
class Launch:
    """What the launcher runs, and where the sidecar then finds it."""

    argv: tuple[str, ...]
    url: str
    """The base URL the sidecar polls (its ``--server``)."""
    added: tuple[str, ...]
    """The arguments the launcher added, for the log."""
    router: bool
    """The arguments put llama-server in router mode (``--models-dir`` / ``--models-preset``)."""
    cache_ram_bytes: int | None = None
    """The size of the RAM prompt cache the arguments give llama-server, in bytes; None: its default."""


def read(args: Sequence[str]) -> dict[str, list[str]]:
    """The values of the flags named here, in order of appearance (``""`` for a flag without a value)."""
    found: dict[str, list[str]] = {}
    i = 0
    while i < len(args):
        flag, eq, value = args[i].partition("=")
        i += 1
        if not flag.startswith("--") and flag not in CACHE_RAM:
            continue
        if flag in _WITH_VALUE and not eq:
            value = args[i] if i < len(args) else ""
            i += 1
        found.setdefault(flag, []).append(value)
    return found


def plan(
    command: Sequence[str],
    *,
    slot_dir: Path,
    proxy: bool,
    port: int,
    sidecar_has_key: bool,
    server_given: str | None = None,
    resolve: Callable[[str], Path] = lambda p: Path(p).resolve(),
) -> Launch:
    """The command to run; raises ``errors.ConfigError`` naming the flag that conflicts.

    ``port``: the free local port the caller picked for the server (used with the proxy only);
    ``server_given``: how the sidecar's own ``--server`` was set (the flag or its variable), if it was.
    """
    if not command:
        raise errors.ConfigError("nothing after '--': give the llama-server command, e.g. -- llama-server -m MODEL")
    if server_given is not None:
        raise errors.ConfigError(
            f"{server_given} is set, but the sidecar starts llama-server itself (the command after '--') and "
            "talks to it: drop it"
        )
    args = list(command[1:])
    found = read(args)
    added: list[str] = []
    for path in found.get(SLOT_SAVE_PATH, []):
        if resolve(path) != slot_dir:
            raise errors.ConfigError(
                f"llama-server's {SLOT_SAVE_PATH} {path} is not the sidecar's --slot-dir {slot_dir}: the sidecar "
                f"saves and restores slots through that one directory; drop {SLOT_SAVE_PATH} (the launcher adds it)"
            )
    if NO_SLOTS in found:
        raise errors.ConfigError(
            f"llama-server's {NO_SLOTS} turns off /slots, which the sidecar reads to know what to save: drop it"
        )
    if not sidecar_has_key and (keyed := [flag for flag in API_KEYS if flag in found]):
        raise errors.ConfigError(
            f"llama-server's {keyed[0]} makes it refuse the sidecar, which has no key: give the sidecar one of "
            "its keys too (--api-key-file or LLAMA_API_KEY_FILE, or --api-key or LLAMA_API_KEY)"
        )
    if SLOT_SAVE_PATH not in found:
        added += [SLOT_SAVE_PATH, str(slot_dir)]
    if METRICS not in found:
        added.append(METRICS)
    if proxy:
        for flag in (HOST, PORT):
            if flag in found:
                raise errors.ConfigError(
                    f"llama-server's {flag} conflicts with --proxy-listen: clients reach llama-server through the "
                    f"proxy's address, and the launcher gives llama-server a free local port; drop {flag}"
                )
        added += [HOST, LOCAL_HOST, PORT, str(port)]
        url = f"http://{LOCAL_HOST}:{port}"
    else:
        url = _url_of(found)
    return Launch(
        argv=(command[0], *args, *added),
        url=url,
        added=tuple(added),
        router=any(flag in found for flag in ROUTER),
        cache_ram_bytes=_cache_ram(found),
    )


def _cache_ram(found: dict[str, list[str]]) -> int | None:
    """The RAM prompt cache ``--cache-ram``/``-cram`` gives llama-server, in bytes (the last one wins)."""
    values = [v for flag in CACHE_RAM for v in found.get(flag, [])]
    if not values:
        return None
    try:
        mib = int(values[-1])
    except ValueError:
        raise errors.ConfigError(
            f"llama-server's --cache-ram {values[-1]!r} is not a whole number of MiB (-1: no limit, 0: none)"
        ) from None
    return CACHE_RAM_UNLIMITED if mib < 0 else mib << 20


def _url_of(found: dict[str, list[str]]) -> str:
    """Where llama-server listens with the user's own ``--host`` and ``--port`` (the last of each wins)."""
    host = found.get(HOST, [LOCAL_HOST])[-1]
    if host.endswith(".sock"):
        raise errors.ConfigError(
            f"llama-server's {HOST} {host} is a unix socket; the sidecar talks to llama-server over TCP: give a "
            f"TCP address, or use --proxy-listen and drop {HOST}"
        )
    host = _WILDCARDS.get(host, host) or LOCAL_HOST
    text = found.get(PORT, [str(SERVER_DEFAULT_PORT)])[-1]
    if text == "0":
        raise errors.ConfigError(f"llama-server's {PORT} 0 lets it pick a port the sidecar cannot know: give one")
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise errors.ConfigError(f"llama-server's {PORT} {text!r} is not a TCP port (1-65535)")
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{int(text)}"
