"""The command line the launcher gives llama-server: the user's arguments and what the sidecar needs. Pure code.

Invariants and trade-offs: docs/modules.md, `sidecar/launch/argv.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
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
MODEL = ("-m", "--model")
CTX_SIZE = ("-c", "--ctx-size")
CACHE_TYPES = ("-ctk", "--cache-type-k", "-ctv", "--cache-type-v")
_SHORT = frozenset({*CACHE_RAM, MODEL[0], CTX_SIZE[0], CACHE_TYPES[0], CACHE_TYPES[2]})
"""Short flags read here (every other short flag is skipped, with its value if it has one, as any word)."""
_WITH_VALUE = frozenset({SLOT_SAVE_PATH, HOST, PORT, *API_KEYS, *ROUTER, *CACHE_RAM, *MODEL, *CTX_SIZE, *CACHE_TYPES})
ENV_HOST = "LLAMA_ARG_HOST"
ENV_PORT = "LLAMA_ARG_PORT"
AIP_MODE = "AIP_MODE"
AIP_HTTP_PORT = "AIP_HTTP_PORT"
"""Vertex AI mode (``AIP_MODE=PREDICTION``): llama-server binds ``AIP_HTTP_PORT`` (default 8080), whatever
``--port`` says."""
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
    listen: tuple[tuple[str, ...], int] | None = None
    """Behind the proxy: the address(es) and port llama-server would have listened on, which the proxy takes."""
    env: tuple[tuple[str, str], ...] = ()
    """Variables set in the child's environment (over the sidecar's own): Vertex AI mode's private port."""
    taken: tuple[str, ...] = ()
    """What the proxy took over from llama-server's arguments or environment, for the log."""


@dataclasses.dataclass(frozen=True, slots=True)
class Sizing:
    """What the command tells of the largest slot file: the model, the context, the KV cache's types."""

    model: str | None
    ctx_size: int
    """``-c``; 0: the model's own context length."""
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"


def sizing(command: Sequence[str], env: Mapping[str, str]) -> Sizing:
    """The model, context size and KV cache types of a llama-server command (flags win over its variables)."""
    found = read(list(command[1:]))

    def last(flags: Sequence[str], variable: str, default: str) -> str:
        values = [v for flag in flags for v in found.get(flag, [])]
        return values[-1] if values else env.get(variable) or default

    text = last(CTX_SIZE, "LLAMA_ARG_CTX_SIZE", "0")
    return Sizing(
        model=last(MODEL, "LLAMA_ARG_MODEL", "") or None,
        ctx_size=int(text) if text.isdigit() else 0,
        cache_type_k=last(CACHE_TYPES[:2], "LLAMA_ARG_CACHE_TYPE_K", "f16"),
        cache_type_v=last(CACHE_TYPES[2:], "LLAMA_ARG_CACHE_TYPE_V", "f16"),
    )


def read(args: Sequence[str]) -> dict[str, list[str]]:
    """The values of the flags named here, in order of appearance (``""`` for a flag without a value)."""
    found: dict[str, list[str]] = {}
    i = 0
    while i < len(args):
        flag, eq, value = args[i].partition("=")
        i += 1
        if not flag.startswith("--") and flag not in _SHORT:
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
    env: Mapping[str, str] | None = None,
    resolve: Callable[[str], Path] = lambda p: Path(p).resolve(),
) -> Launch:
    """The command to run; raises ``errors.ConfigError`` naming the flag that conflicts.

    ``port``: the free local port the caller picked for the server (used with the proxy only);
    ``server_given``: how the sidecar's own ``--server`` was set (the flag or its variable), if it was;
    ``env``: the environment the child inherits (its ``LLAMA_ARG_*`` and ``AIP_*`` variables are read).
    With the proxy, llama-server's own address (``--host``/``--port``, their variables, Vertex AI's
    ``AIP_HTTP_PORT``, or its default 127.0.0.1:8080) becomes :attr:`Launch.listen`, and llama-server is
    given ``127.0.0.1:port`` instead.
    """
    env = {} if env is None else env
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
                f"llama-server's {SLOT_SAVE_PATH} {path} is not the sidecar's slot dir {slot_dir}: the sidecar "
                f"saves and restores slots through that one directory; drop {SLOT_SAVE_PATH} (the launcher adds "
                f"it: a RAM staging dir, the snapshots kept in --state-dir), or give the sidecar --slot-dir {path}"
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
    listen = None
    child_env: list[tuple[str, str]] = []
    taken: list[str] = []
    if proxy:
        listen, taken = _address_of(found, env)
        args = without(args, (HOST, PORT))
        added += [HOST, LOCAL_HOST, PORT, str(port)]
        if env.get(AIP_MODE) == "PREDICTION":
            child_env.append((AIP_HTTP_PORT, str(port)))  # llama-server binds it whatever --port says
        url = f"http://{LOCAL_HOST}:{port}"
    else:
        url = _url_of(found, env)
    return Launch(
        argv=(command[0], *args, *added),
        url=url,
        added=tuple(added),
        router=any(flag in found for flag in ROUTER),
        cache_ram_bytes=_cache_ram(found),
        listen=listen,
        env=tuple(child_env),
        taken=tuple(taken),
    )


def key_argument(command: Sequence[str]) -> tuple[str, str] | None:
    """llama-server's own ``--api-key KEYS`` or ``--api-key-file FILE`` in ``command`` (the last one), if any."""
    found = read(list(command[1:]))
    given = [(flag, value) for flag in API_KEYS for value in found.get(flag, [])]
    return given[-1] if given else None


def without(args: Sequence[str], flags: Sequence[str]) -> list[str]:
    """``args`` less every ``flags`` flag and its value (``--flag V`` or ``--flag=V``)."""
    kept: list[str] = []
    i = 0
    while i < len(args):
        flag, eq, _ = args[i].partition("=")
        i += 1
        if flag in flags:
            if not eq:
                i += 1
            continue
        kept.append(args[i - 1])
    return kept


def _address_of(found: dict[str, list[str]], env: Mapping[str, str]) -> tuple[tuple[tuple[str, ...], int], list[str]]:
    """The address(es) and port llama-server would listen on, which the proxy takes; and where each came from.

    ``--host`` takes a comma-separated list (llama-server listens on each); ``AIP_MODE=PREDICTION``
    makes llama-server bind ``AIP_HTTP_PORT`` whatever ``--port`` says, and so does the proxy.
    """
    taken: list[str] = []
    if HOST in found:
        text, source = found[HOST][-1], HOST
    else:
        text, source = env.get(ENV_HOST, ""), ENV_HOST
    hosts = tuple(h.strip() for h in text.split(",") if h.strip()) or (LOCAL_HOST,)
    if text:
        taken.append(source)
    if sockets := [h for h in hosts if h.endswith(".sock")]:
        raise errors.ConfigError(
            f"llama-server's {source} {sockets[0]} is a unix socket; the proxy listens on TCP: give a TCP "
            f"address (or --no-proxy to run beside llama-server)"
        )
    if env.get(AIP_MODE) == "PREDICTION":
        text, source = env.get(AIP_HTTP_PORT) or str(SERVER_DEFAULT_PORT), AIP_HTTP_PORT
        taken.append(source)
    elif PORT in found:
        text, source = found[PORT][-1], PORT
        taken.append(source)
    elif env.get(ENV_PORT):
        text, source = env[ENV_PORT], ENV_PORT
        taken.append(source)
    else:
        text, source = str(SERVER_DEFAULT_PORT), PORT
    if not text.isdigit() or not 0 <= int(text) < 65536:
        raise errors.ConfigError(f"llama-server's {source} {text!r} is not a TCP port (0-65535)")
    return (tuple(h.strip("[]") for h in hosts), int(text)), taken


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


def _url_of(found: dict[str, list[str]], env: Mapping[str, str]) -> str:
    """Where llama-server listens with the user's own ``--host`` and ``--port`` (the last of each wins)."""
    host = found.get(HOST, [env.get(ENV_HOST) or LOCAL_HOST])[-1].split(",")[0].strip()
    if host.endswith(".sock"):
        raise errors.ConfigError(
            f"llama-server's {HOST} {host} is a unix socket; the sidecar talks to llama-server over TCP: give a "
            f"TCP address, or run the proxy in front (drop --no-proxy)"
        )
    host = _WILDCARDS.get(host, host) or LOCAL_HOST
    text = found.get(PORT, [env.get(ENV_PORT) or str(SERVER_DEFAULT_PORT)])[-1]
    if env.get(AIP_MODE) == "PREDICTION":
        text = env.get(AIP_HTTP_PORT) or str(SERVER_DEFAULT_PORT)
    if text == "0":
        raise errors.ConfigError(f"llama-server's {PORT} 0 lets it pick a port the sidecar cannot know: give one")
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise errors.ConfigError(f"llama-server's {PORT} {text!r} is not a TCP port (1-65535)")
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{int(text)}"
