"""Settings, grouped by concern, built once in ``__main__`` and passed down.

Each default is written once, here, with its unit in the attribute
docstring: the command line shows these defaults in its help and applies
them to every flag left unset. Every duration is in float seconds and every
size in bytes. Nothing has to be given by the user in launcher mode; beside a server started
elsewhere, its slot directory.
"""

from __future__ import annotations

import dataclasses
import urllib.parse
from pathlib import Path

from sidecar.core import apikeys, location

MAX_UNSAVED_SECONDS = 10.0
"""The default of ``SnapshotSettings.max_unsaved_seconds`` (``--max-unsaved-seconds``)."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class UpstreamSettings:
    url: str = "http://127.0.0.1:8080"
    """Base URL of llama-server."""
    api_key: str | None = None
    """One of llama-server's API keys, sent as ``Authorization: Bearer``; never logged."""
    keys: apikeys.Keys | None = None
    """All of llama-server's API keys (with their pools): the proxy checks each client's key against them and
    keeps each key's conversations apart; None: the server has no keys, and everything is shared."""
    request_timeout: float = 5.0
    """Timeout of /health, /slots, /props and /metrics calls, in seconds."""
    action_timeout: float = 300.0
    """Timeout of a slot save or restore call, in seconds (big models write GBs)."""
    connect_timeout: float = 2.0
    """Timeout of opening the TCP connection, in seconds."""
    router: bool | None = None
    """llama-server runs in router mode (``--models-dir`` / ``--models-preset``): one engine per model.
    None: follow the server (``/props`` of a router says ``"role": "router"``); True or False forces it."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PollSettings:
    interval: float = 1.0
    """Seconds between polls while the server is up."""
    down_interval: float = 0.25
    """Seconds between /health polls while the server is down or loading."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotSettings:
    slot_dir: Path
    """The server's ``--slot-save-path``, seen from the sidecar (a directory)."""
    store_dir: Path | None = None
    """Where snapshots persist as blocks and manifests (see docs/blocks.md); the slot dir is then only
    where llama-server writes and reads (staging, normally a tmpfs). None: whole files in the slot dir."""
    staging: str = ""
    """Where the slot dir is, for the log, /status and the page: ``ram`` (a tmpfs dir the launcher made),
    ``disk`` (the state dir's, when no tmpfs had room), ``given`` (``--slot-dir``), or "" (beside a server)."""
    staging_note: str = ""
    """What staging on disk costs, and the fix; "" when staging is in RAM or given."""
    staging_bytes_per_token: int = 0
    """Before any snapshot of the model is known, the bytes per token of a slot file the staging decision
    assumes (the launcher's estimate from the model's header, an upper bound): a first save too large for the
    RAM staging dir is staged on disk instead of failing. 0: none (nothing staged on disk for want of an
    estimate)."""
    convert_dir: Path | None = None
    """A directory of whole-file snapshots from before the block store, converted into it at start-up (besides
    the slot dir itself); None: none."""
    idle_seconds: float = 2.0
    """A slot is saved once it has been idle this many seconds after a change."""
    interval: float = 300.0
    """A changed slot is saved at least this often, in seconds, even if it never settles."""
    min_tokens: int = 256
    """Slots holding fewer tokens than this are not worth a file."""
    hold_seconds: float = 30.0
    """A due save waits for a moment when no other slot is processing at most this many seconds
    after the slot's oldest unsaved change (never past ``interval``); 0 means it never waits.
    Under steady traffic on several slots no such moment comes: this bounds what a crash of
    llama-server loses then (the turns of the last ``hold_seconds`` plus ``idle_seconds``), unless
    ``max_unsaved_seconds`` keeps holding it past that."""
    max_unsaved_seconds: float = MAX_UNSAVED_SECONDS
    """What a crash of llama-server may cost, in seconds of re-prefill at its measured rate, to keep a save's
    stall (every slot waits while the server writes the whole slot) off the other slots. A due save held
    ``hold_seconds`` while another slot is processing is made only if the slot's tokens past its last snapshot
    re-prefill at least as slowly as the save would stall, or slower than this; else it keeps waiting for a
    moment when no other slot is processing. With the proxy, once llama-server's RAM cache has served a
    conversation, one leaves its slot for it with no save first while what a crash would lose of it re-prefills
    within this. 0: neither (saved once the hold runs out, and before a conversation leaves its slot)."""
    keep_per_slot: int = 2
    """A snapshot goes once this many newer snapshots extend its tokens (of snapshots not indexed by content,
    the newest this many per slot stay), a count (at least 1)."""
    max_bytes: int = 0
    """Cap on all snapshots together, in bytes; 0 means no cap."""
    max_age: float = 0.0
    """Snapshots older than this many seconds are deleted; 0 means no age limit."""
    min_free_bytes: int = 1 << 30
    """Free bytes kept on the disk the snapshots live on: the least recently used snapshots go to make room
    for a save, which is skipped when deleting every one not in use would not make room."""
    final_timeout: float = 20.0
    """Budget for the final snapshots at shutdown, in seconds."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ServerSettings:
    host: str = "127.0.0.1"
    """Address the sidecar's HTTP endpoints listen on."""
    port: int = 9464
    """TCP port of the sidecar's HTTP endpoints; 0 picks a free one."""
    admin_token: str | None = None
    """Enables POST /snapshot and /restore; without it they answer 403."""
    status_requires_token: bool = False
    """Whether GET /status needs the admin token too (it lists slots, snapshots and the model path)."""
    agent_host: str | None = None
    """Address of the HAProxy agent-check port (``--agent-check-listen``); None: no agent port."""
    agent_port: int = 0
    """TCP port of the agent-check port; 0 picks a free one."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LogSettings:
    format: str = "auto"
    """json, console, or auto (console on a terminal, else json)."""
    level: str = "info"
    """debug, info, warning or error."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ProxySettings:
    host: str | None = None
    """Address the proxy listens on; None: no proxy (the sidecar stays out of the request path)."""
    port: int = 0
    hold_seconds: float = 120.0
    """Longest a completion request waits at the restore gate before a 503 with Retry-After."""
    max_body_bytes: int = 32 << 20
    """Largest request body the proxy accepts (413 above it); bodies are kept for one replay."""
    max_inflight_body_bytes: int = 256 << 20
    """Bytes of request bodies the proxy holds at once, all clients together (503 above it): bounds its
    memory whatever clients send."""
    body_timeout: float = 60.0
    """Seconds a request body may take to arrive in full (408 past it)."""
    max_connections: int = 1000
    """Client connections open at once; one more is answered 503 and closed."""
    idle_timeout: float = 75.0
    """Seconds a client connection may sit without a complete request (idle keep-alive or
    headers sent slowly) before the proxy closes it."""
    retry_after: int = 10
    """Seconds suggested in Retry-After when a held request times out."""
    prefix_header: bool = True
    """Tell each routed completion's client where its prompt's prefix came from, in a response header."""
    server_cache_ram_bytes: int = 8192 << 20
    """The size of llama-server's RAM prompt cache (its ``--cache-ram``, in MiB there, 8192 by default), in bytes:
    the library pins a conversation that left its slot to an idle one with nothing restored while that cache
    should still hold it (the server loads it from RAM, faster than a file); 0: the server runs without one."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LaunchSettings:
    state_dir: Path | None = None
    """Where the block store (``store/``) and a staging dir on disk (``slots/``) live, created 0700 when missing;
    None: ``$XDG_STATE_HOME/llama-kv-sidecar``, else ``~/.local/state/llama-kv-sidecar``."""
    proxy: bool = True
    """In launcher mode, the proxy takes llama-server's address and llama-server moves to a private port;
    False: the sidecar runs beside it (the proxy only with ``--proxy-listen``)."""
    whole_files: bool = False
    """One whole file per snapshot in the slot dir instead of the block store."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SharedSettings:
    location: location.Location | None = None
    """The shared store (``--shared-store``) with its endpoint and keys; None: snapshots stay on this node."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    upstream: UpstreamSettings
    poll: PollSettings
    snapshots: SnapshotSettings
    server: ServerSettings
    logs: LogSettings = dataclasses.field(default_factory=LogSettings)
    proxy: ProxySettings = dataclasses.field(default_factory=ProxySettings)
    shared: SharedSettings = dataclasses.field(default_factory=SharedSettings)
    launch: LaunchSettings = dataclasses.field(default_factory=LaunchSettings)

    def secrets(self) -> tuple[str, ...]:
        """Every secret value set: the admin token, llama-server's API keys and URL password, the shared store's keys.

        ``logs.configure`` is given them, so no log line carries one, whatever the path that led there.
        """
        found = [self.server.admin_token, self.upstream.api_key]
        if self.upstream.keys is not None:
            found.extend(self.upstream.keys.keys)
        found.append(urllib.parse.urlsplit(self.upstream.url).password)
        where = self.shared.location
        if where is not None:
            found.extend((where.secret_access_key, where.session_token))
        return tuple(sorted({s for s in found if s}))
