"""Settings, grouped by concern, built once in ``__main__`` and passed down.

Every duration is in float seconds and every size in bytes. Defaults here
are the ones the command line documents; only the upstream URL and the
slot directory have to be given by the user.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class UpstreamSettings:
    url: str = "http://127.0.0.1:8080"
    """Base URL of llama-server."""
    api_key: str | None = None
    """Sent as ``Authorization: Bearer``; never logged."""
    request_timeout: float = 5.0
    """Timeout of /health, /slots, /props and /metrics calls, in seconds."""
    action_timeout: float = 300.0
    """Timeout of a slot save or restore call, in seconds (big models write GBs)."""
    connect_timeout: float = 2.0
    """Timeout of opening the TCP connection, in seconds."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PollSettings:
    interval: float = 1.0
    """Seconds between polls while the server is up."""
    down_interval: float = 0.25
    """Seconds between /health polls while the server is down or loading."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotSettings:
    slot_dir: Path
    """The server's ``--slot-save-path``, seen from the sidecar."""
    idle_seconds: float = 2.0
    """A slot is saved once it has been idle this long after a change."""
    interval: float = 300.0
    """A changed slot is saved at least this often even if it never settles."""
    min_tokens: int = 256
    """Slots holding fewer tokens are not worth a file."""
    keep_per_slot: int = 2
    """Newest snapshots kept per slot (at least 1)."""
    max_bytes: int = 0
    """Cap on all snapshots together; 0 means no cap."""
    max_age: float = 0.0
    """Snapshots older than this are deleted; 0 means no age limit."""
    min_free_bytes: int = 1 << 30
    """Saves are skipped when the filesystem would drop below this."""
    final_timeout: float = 20.0
    """Budget for the final snapshots at shutdown, in seconds."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 9464
    admin_token: str | None = None
    """Enables POST /snapshot and /restore; without it they answer 403."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    upstream: UpstreamSettings
    poll: PollSettings
    snapshots: SnapshotSettings
    server: ServerSettings
