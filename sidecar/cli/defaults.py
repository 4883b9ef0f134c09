"""The whole product by default: the directories, the proxy's address and the key a run takes without a flag.

In launcher mode (``run -- llama-server ARGS``) nothing has to be given: the state dir is created,
the block store lives in it, llama-server saves into a RAM staging dir (or, when no tmpfs has room,
the state dir's ``slots/`` on disk), and the proxy takes llama-server's own address. Beside a
server started elsewhere, a slot dir on a tmpfs gets the block store in the state dir too; a slot
dir on a disk keeps whole files (the start-up log says so, with the fix).

Everything that can be refused is refused here, before anything starts (exit status 2): a state dir
that cannot be created or written, a second sidecar on it (its lock), an address already taken.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import os
import socket
from collections.abc import Iterator, Mapping
from pathlib import Path

from sidecar.cli import options, parsing
from sidecar.core import config, errors, mounts, parse
from sidecar.launch import argv as launch_argv
from sidecar.launch import places, slotsize
from sidecar.snapshots import dirlock


@dataclasses.dataclass(slots=True)
class Prepared:
    """What a run was given by default, and what it must give back at exit (:meth:`close`)."""

    settings: config.Settings
    launch: launch_argv.Launch | None = None
    state_lock: dirlock.DirLock | None = None
    ram_dir: Path | None = None
    """The RAM staging dir this run made (removed at exit)."""

    def close(self) -> None:
        if self.ram_dir is not None:
            places.remove_ram_dir(self.ram_dir)
        if self.state_lock is not None:
            self.state_lock.release()


@contextlib.contextmanager
def prepared(
    ns: argparse.Namespace, settings: config.Settings, command: list[str] | None, env: Mapping[str, str]
) -> Iterator[Prepared]:
    """The settings (and launch) a run uses; what it made is given back when the block ends."""
    done = Prepared(settings)
    try:
        if command is not None:
            _launching(done, ns, command, env)
        else:
            _beside(done, ns, env)
        yield done
    finally:
        done.close()


def _state_dir(done: Prepared, ns: argparse.Namespace, env: Mapping[str, str]) -> Path:
    """The state dir, created and checked, its lock held (one sidecar per state dir)."""
    given = done.settings.launch.state_dir
    raw = parsing.raw_value(ns, options.STATE_DIR)
    flag = options.STATE_DIR.flag if raw is None or raw[1] is parsing.Source.FLAG else options.STATE_DIR.env
    path = (given if given is not None else places.default_state_dir(env)).resolve()
    if given is None:  # the XDG base dir (~/.local/state) may not exist yet on a fresh machine
        places.parents(path)
    places.prepare(path, flag=flag)
    lock = dirlock.DirLock(path, kind="state dir", remedy=f"give this one a {options.STATE_DIR.flag} of its own")
    lock.acquire()
    done.state_lock = lock
    done.settings = dataclasses.replace(done.settings, launch=dataclasses.replace(done.settings.launch, state_dir=path))
    return path


def _beside(done: Prepared, ns: argparse.Namespace, env: Mapping[str, str]) -> None:
    """Beside a server started elsewhere: the block store in the state dir when the slot dir is a tmpfs."""
    snap = done.settings.snapshots
    if snap.store_dir is not None or done.settings.launch.whole_files or not mounts.on_tmpfs(snap.slot_dir):
        return
    state = _state_dir(done, ns, env)
    store = places.store_dir(state, flag=options.STATE_DIR.flag)
    done.settings = dataclasses.replace(
        done.settings, snapshots=dataclasses.replace(snap, store_dir=store, staging=places.Staging.GIVEN.value)
    )


def _launching(done: Prepared, ns: argparse.Namespace, command: list[str], env: Mapping[str, str]) -> None:
    settings = done.settings
    given = parsing.raw_value(ns, options.SERVER)
    named = options.SERVER.flag if given is not None and given[1] is parsing.Source.FLAG else options.SERVER.env
    if given is not None:
        launch_argv.plan(command, slot_dir=Path("/"), proxy=False, port=1, sidecar_has_key=True, server_given=named)
    settings = _adopt_key(settings, command)
    proxy = settings.launch.proxy or settings.proxy.host is not None
    listen = None
    if proxy and settings.proxy.host is None:
        listen = launch_argv.plan(
            command, slot_dir=Path("/"), proxy=True, port=1, sidecar_has_key=True, resolve=lambda _: Path("/"), env=env
        ).listen
    if listen is not None:
        _check_free(listen, how="llama-server's own address (its --host/--port)")
        settings = dataclasses.replace(
            settings, proxy=dataclasses.replace(settings.proxy, host=",".join(listen[0]), port=listen[1])
        )
    elif settings.proxy.host is not None:
        _check_free((tuple(settings.proxy.host.split(",")), settings.proxy.port), how=options.PROXY_LISTEN.flag)
    state = _state_dir(done, ns, env)
    settings = dataclasses.replace(settings, launch=done.settings.launch)
    snapshots = _directories(done, settings, state, command, env)
    settings = dataclasses.replace(settings, snapshots=snapshots)
    launch = launch_argv.plan(
        command,
        slot_dir=snapshots.slot_dir,
        proxy=settings.proxy.host is not None,
        port=_free_port(),
        sidecar_has_key=settings.upstream.api_key is not None,
        env=env,
    )
    if settings.proxy.host is not None:  # where the proxy listens: the server's own address, or --proxy-listen
        launch = dataclasses.replace(launch, listen=(tuple(settings.proxy.host.split(",")), settings.proxy.port))
    router = settings.upstream.router if settings.upstream.router is not None else launch.router
    upstream = dataclasses.replace(settings.upstream, url=launch.url, router=router)
    proxy_settings = settings.proxy
    if launch.cache_ram_bytes is not None and parsing.raw_value(ns, options.SERVER_CACHE_RAM) is None:
        # The library routes below llama-server's RAM cache: its size is known from the arguments.
        proxy_settings = dataclasses.replace(proxy_settings, server_cache_ram_bytes=launch.cache_ram_bytes)
    done.settings = dataclasses.replace(settings, upstream=upstream, proxy=proxy_settings)
    done.launch = launch


def _directories(
    done: Prepared, settings: config.Settings, state: Path, command: list[str], env: Mapping[str, str]
) -> config.SnapshotSettings:
    """The block store in the state dir (unless ``--whole-files``), and the slot dir: the one given, else RAM
    staging when a tmpfs has room for the largest slot, else the state dir's ``slots/`` on disk."""
    snap = settings.snapshots
    store = snap.store_dir
    if store is None and not settings.launch.whole_files:
        store = places.store_dir(state, flag=options.STATE_DIR.flag)
    slots = state / places.SLOTS
    staging, note, convert = places.Staging.GIVEN.value, "", None
    slot_dir = snap.slot_dir
    if slot_dir == parsing.PENDING_SLOT_DIR and store is None:  # whole files persist: on disk, never in RAM
        slot_dir, staging = places.subdir(state, places.SLOTS), places.Staging.DISK.value
    elif slot_dir == parsing.PENDING_SLOT_DIR:
        sized = _slot_bytes(command, env)
        if sized is not None:
            snap = dataclasses.replace(snap, staging_bytes_per_token=sized[1])
        choice = places.choose(slot_bytes=None if sized is None else sized[0], tmpfs_free=places.tmpfs_free(places.SHM))
        staging, note = choice.staging.value, choice.why
        if choice.staging is places.Staging.RAM:
            slot_dir = places.ram_dir(state, places.SHM)
            places.make_ram_dir(slot_dir)
            done.ram_dir = slot_dir
            convert = slots if slots.is_dir() else None  # whole files of a run with --whole-files
        else:
            slot_dir = places.subdir(state, places.SLOTS)
    return dataclasses.replace(
        snap, slot_dir=slot_dir, store_dir=store, staging=staging, staging_note=note, convert_dir=convert
    )


def _adopt_key(settings: config.Settings, command: list[str]) -> config.Settings:
    """With no key of its own, the sidecar takes llama-server's ``--api-key``/``--api-key-file`` from the command."""
    if settings.upstream.api_key is not None:
        return settings
    found = launch_argv.key_argument(command)
    if found is None:
        return settings
    flag, value = found
    first, keys = parse.first_key(value) if flag == "--api-key" else parse.key_file(value)
    return dataclasses.replace(settings, upstream=dataclasses.replace(settings.upstream, api_key=first, keys=keys))


def _slot_bytes(command: list[str], env: Mapping[str, str]) -> tuple[int, int] | None:
    """The largest slot file the command can write, and its bytes per token; None when its model cannot be read
    (a download, ...)."""
    sized = launch_argv.sizing(command, env)
    if sized.model is None:
        return None
    try:
        shape = slotsize.of_model(Path(sized.model))
    except (OSError, ValueError):
        return None
    types = {"cache_type_k": sized.cache_type_k, "cache_type_v": sized.cache_type_v}
    return slotsize.slot_bytes(shape, ctx_size=sized.ctx_size, **types), slotsize.slot_bytes(shape, ctx_size=1, **types)


def _check_free(listen: tuple[tuple[str, ...], int], *, how: str) -> None:
    """Refuse an address the proxy cannot take (in use, or not this host's), before anything starts."""
    hosts, port = listen
    if port == 0:
        return
    for host in hosts:
        try:
            infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except OSError as exc:
            raise errors.ConfigError(f"{how}: {host!r} is not an address of this host ({exc})") from None
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise errors.ConfigError(
                        f"{how}: {host}:{port} is already in use (another llama-server or sidecar?): the proxy "
                        "takes that address for clients; stop what holds it, or give llama-server another --port"
                    ) from None
                raise errors.ConfigError(f"{how}: cannot listen on {host}:{port} ({exc.strerror or exc})") from None


def _free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago: llama-server's, behind the proxy."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((launch_argv.LOCAL_HOST, 0))
        return int(sock.getsockname()[1])


def environment() -> Mapping[str, str]:
    return os.environ
