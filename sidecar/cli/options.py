"""The settings of ``llama-kv-sidecar run``: one table of flag, environment variable and field.

Each row of :data:`OPTIONS` names a flag, the environment variable that
stands in for it, and the ``config.Settings`` field it sets. The flags are
added to argparse with the default ``None``; :func:`settings_from` then
takes each field from its flag, else from its environment variable, else
leaves it to the default written in ``config.py``. The help text shows that
default and the variable's name, so nothing is written twice.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sidecar.core import config, errors, location, logs, parse
from sidecar.shared import connect

_GROUPS: dict[str, type[Any]] = {
    name: kind
    for name, kind in typing.get_type_hints(config.Settings).items()
    if isinstance(kind, type) and dataclasses.is_dataclass(kind)
}
"""The groups of ``config.Settings`` by field name: ``{"upstream": config.UpstreamSettings, ...}``."""


@dataclasses.dataclass(frozen=True, slots=True)
class Option:
    flag: str
    env: str
    fields: tuple[str, ...]
    """``group.name`` of the ``config.Settings`` field(s) the option sets."""
    help: str
    metavar: str | None = None
    convert: Callable[[str], Any] = str
    """Turns the text into a value; argparse reports its errors (exit 2)."""
    check: Callable[[Any], Any] | None = None
    """Validates the parsed value; raises ``errors.ConfigError``. Returns a tuple for several fields."""
    choices: tuple[str, ...] | None = None
    switch: bool = False
    """A flag without a value; the variable takes 1/0, true/false, yes/no, on/off."""

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")


def _default(field: str) -> Any:
    group, name = field.split(".")
    found = {f.name: f.default for f in dataclasses.fields(_GROUPS[group])}
    return found[name]


def _shown_default(option: Option) -> str:
    defaults = [_default(field) for field in option.fields]
    if option.switch or any(d is None or d is dataclasses.MISSING for d in defaults):
        return ""
    return f" (default {':'.join(str(d) for d in defaults)})"


SLOT_DIR = Option(
    "--slot-dir",
    "LLAMA_SIDECAR_SLOT_DIR",
    ("snapshots.slot_dir",),
    "llama-server's --slot-save-path, where it saves and restores slots (beside a server started elsewhere: "
    "required; on a tmpfs the block store keeps the snapshots in --state-dir, on a disk whole files stay here). "
    "In launcher mode the launcher picks it: a RAM staging dir on /dev/shm when that has room for the largest "
    "slot, else --state-dir's slots/ on disk",
    metavar="DIR",
    convert=Path,
    check=Path.resolve,
)
STORE_DIR = Option(
    "--store-dir",
    "LLAMA_SIDECAR_STORE_DIR",
    ("snapshots.store_dir",),
    "keep snapshots here as content-addressed blocks (only blocks the store lacks are written; conversations "
    "sharing a prefix share its blocks); --slot-dir then only stages the files llama-server saves and "
    "restores (put it on a tmpfs); unset: --state-dir's store/ in launcher mode or beside a tmpfs slot dir, "
    "else whole files in --slot-dir",
    metavar="DIR",
    convert=Path,
    check=Path.resolve,
)
SHARED_STORE = Option(
    "--shared-store",
    "LLAMA_SIDECAR_SHARED_STORE",
    ("shared.location",),
    "s3://BUCKET/PREFIX or file:///PATH: upload committed snapshots there in the background and fetch "
    "other nodes' snapshots into empty slots; S3 endpoint and keys come from AWS_ENDPOINT_URL_S3 "
    "(or AWS_ENDPOINT_URL), AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION; s3:// needs the S3 client: "
    "pip install 'llama-kv-sidecar[s3]' (default: off)",
    "URL",
    check=lambda url: connect.require_client(location.parse(url, os.environ)),
)

STATE_DIR = Option(
    "--state-dir",
    "LLAMA_SIDECAR_STATE_DIR",
    ("launch.state_dir",),
    "where the block store (store/) and, when no tmpfs has room, the staging dir (slots/) live; created 0700 "
    "when missing (its parent must exist); one sidecar per state dir (default: $XDG_STATE_HOME/llama-kv-sidecar, "
    "else ~/.local/state/llama-kv-sidecar)",
    metavar="DIR",
    convert=Path,
    check=Path.resolve,
)
NO_PROXY = Option(
    "--no-proxy",
    "LLAMA_SIDECAR_NO_PROXY",
    ("launch.proxy",),
    "launcher mode: run beside llama-server on its own address instead of putting the proxy there (clients "
    "then race a restore after a crash, and there is no conversation library)",
    convert=parse.switch,
    check=lambda off: not off,
    switch=True,
)
WHOLE_FILES = Option(
    "--whole-files",
    "LLAMA_SIDECAR_WHOLE_FILES",
    ("launch.whole_files",),
    "one whole file per snapshot in the slot dir instead of the block store (every save rewrites the whole "
    "slot, every conversation keeps a whole copy of what it shares)",
    convert=parse.switch,
    switch=True,
)

PROXY_LISTEN = Option(
    "--proxy-listen",
    "LLAMA_SIDECAR_PROXY_LISTEN",
    ("proxy.host", "proxy.port"),
    "HOST:PORT of the reverse proxy in front of llama-server; clients that use it wait while llama-server "
    "restarts and its slots are restored instead of failing or re-prefilling (default: in launcher mode, "
    "llama-server's own --host/--port, which move to a private port; beside a server started elsewhere, off)",
    "HOST:PORT",
    check=parse.proxy_listen,
)

SERVER_CACHE_RAM = Option(
    "--server-cache-ram-bytes",
    "LLAMA_SIDECAR_SERVER_CACHE_RAM_BYTES",
    ("proxy.server_cache_ram_bytes",),
    "the size of llama-server's RAM prompt cache (its --cache-ram MiB times 1048576; 0 if it runs with "
    "--cache-ram 0): the library lets that cache serve a conversation that left its slot while it should "
    "still hold it, instead of a swap from disk (in launcher mode: from the command's --cache-ram)",
    "N",
    parse.number(int, zero_ok=True),
)
"""The size of llama-server's RAM prompt cache; in launcher mode taken from the child's ``--cache-ram``."""

SERVER = Option(
    "--server",
    "LLAMA_SIDECAR_SERVER",
    ("upstream.url",),
    "llama-server base URL (not with '-- llama-server ARGS': the launcher points the sidecar at the server it starts)",
    "URL",
    check=parse.url,
)
OPTIONS: tuple[Option, ...] = (
    SERVER,
    STATE_DIR,
    NO_PROXY,
    WHOLE_FILES,
    SLOT_DIR,
    STORE_DIR,
    Option(
        "--listen",
        "LLAMA_SIDECAR_LISTEN",
        ("server.host", "server.port"),
        "HOST:PORT for /metrics, /healthz, /readyz, /status (use 0.0.0.0:9464 in a container)",
        "HOST:PORT",
        check=parse.listen,
    ),
    Option(
        "--poll-interval",
        "LLAMA_SIDECAR_POLL_INTERVAL",
        ("poll.interval",),
        "seconds between polls while the server is up",
        "SEC",
        parse.number(float),
    ),
    Option(
        "--idle-seconds",
        "LLAMA_SIDECAR_IDLE_SECONDS",
        ("snapshots.idle_seconds",),
        "save a slot once it has been idle this many seconds after a change",
        "SEC",
        parse.number(float, zero_ok=True),
    ),
    Option(
        "--snapshot-interval",
        "LLAMA_SIDECAR_SNAPSHOT_INTERVAL",
        ("snapshots.interval",),
        "save a changed slot at least this often, in seconds, even if it never stays idle --idle-seconds long",
        "SEC",
        parse.number(float),
    ),
    Option(
        "--save-hold-seconds",
        "LLAMA_SIDECAR_SAVE_HOLD_SECONDS",
        ("snapshots.hold_seconds",),
        "a due save waits for a moment when no other slot is processing (a save stalls every slot), at most "
        "this many seconds after the slot's oldest unsaved change and never past --snapshot-interval, then "
        "is made if it is worth its stall (see --max-unsaved-seconds): under steady traffic on several slots "
        "a crash of llama-server loses at most the turns of this many seconds (plus --idle-seconds), or a "
        "tail that re-prefills faster than a save would stall and within --max-unsaved-seconds; 0 = save at "
        "once",
        "SEC",
        parse.number(float, zero_ok=True),
    ),
    Option(
        "--max-unsaved-seconds",
        "LLAMA_SIDECAR_MAX_UNSAVED_SECONDS",
        ("snapshots.max_unsaved_seconds",),
        "what a crash of llama-server may cost, in seconds of re-prefill at its measured rate, to keep a save's "
        "stall (every slot waits while the server writes the whole slot) off the other slots: a due save past "
        "--save-hold-seconds while another slot is processing is made only if the slot's tokens past its last "
        "snapshot re-prefill at least as slowly as the save would stall, or slower than this; with the proxy, "
        "once llama-server's RAM cache has served a conversation, one leaves its slot for it without a save "
        "first while what a crash would lose of it re-prefills within this; 0: neither (saved when the hold "
        "runs out, and before a conversation leaves its slot)",
        "SEC",
        parse.number(float, zero_ok=True),
    ),
    Option(
        "--min-tokens",
        "LLAMA_SIDECAR_MIN_TOKENS",
        ("snapshots.min_tokens",),
        "do not save slots holding fewer tokens",
        "N",
        parse.number(int, zero_ok=True),
    ),
    Option(
        "--api-key",
        "LLAMA_API_KEY",
        ("upstream.api_key", "upstream.keys"),
        "llama-server's --api-key, sent as a Bearer token, never logged; of a comma-separated list "
        "(key rotation) the first key is sent, and the proxy refuses clients whose key is none of them and keeps "
        "each key's conversations apart; prefer --api-key-file: flags show in the process list",
        "KEY",
        check=parse.first_key,
    ),
    Option(
        "--api-key-file",
        "LLAMA_API_KEY_FILE",
        ("upstream.api_key", "upstream.keys"),
        "read the API keys from this file instead: llama-server's --api-key-file format, one key per line, "
        "# for comments; the first key is sent; a '# pool: NAME' line puts the keys after it in one pool, whose "
        "keys share their conversations through the proxy",
        "FILE",
        check=parse.key_file,
    ),
    Option(
        "--admin-token",
        "LLAMA_SIDECAR_ADMIN_TOKEN",
        ("server.admin_token",),
        "enables POST /snapshot and /restore for callers sending it as a Bearer token; at least 16 characters, "
        "no surrounding whitespace; prefer --admin-token-file: flags show in the process list",
        "TOKEN",
        check=parse.admin_token,
    ),
    Option(
        "--admin-token-file",
        "LLAMA_SIDECAR_ADMIN_TOKEN_FILE",
        ("server.admin_token",),
        "read the admin token from this file instead (a trailing newline is ignored; the same rules)",
        "FILE",
        check=parse.token_file,
    ),
    Option(
        "--status-requires-token",
        "LLAMA_SIDECAR_STATUS_REQUIRES_TOKEN",
        ("server.status_requires_token",),
        "GET /status answers only callers sending the admin token (it lists slots, snapshots and the model path)",
        convert=parse.switch,
        switch=True,
    ),
    Option(
        "--keep-per-slot",
        "LLAMA_SIDECAR_KEEP_PER_SLOT",
        ("snapshots.keep_per_slot",),
        "a snapshot is deleted once N newer snapshots extend its tokens (unindexed ones: the newest N per slot kept)",
        "N",
        parse.number(int),
    ),
    Option(
        "--max-bytes",
        "LLAMA_SIDECAR_MAX_BYTES",
        ("snapshots.max_bytes",),
        "cap on all snapshots together, in bytes; 0 = no cap; a slot's newest snapshot is never deleted",
        "N",
        parse.number(int, zero_ok=True),
    ),
    Option(
        "--max-age",
        "LLAMA_SIDECAR_MAX_AGE",
        ("snapshots.max_age",),
        "delete snapshots older than this many seconds, except a slot's newest; 0 = no limit",
        "SEC",
        parse.number(float, zero_ok=True),
    ),
    Option(
        "--min-free-bytes",
        "LLAMA_SIDECAR_MIN_FREE_BYTES",
        ("snapshots.min_free_bytes",),
        "free space kept on the disk the snapshots live on (the slot dir's, or with --store-dir the store's), in "
        "bytes: a save that would go below it first deletes the least recently used snapshots not in use, just "
        "enough, and is skipped if that would not do",
        "N",
        parse.number(int, zero_ok=True),
    ),
    Option(
        "--final-timeout",
        "LLAMA_SIDECAR_FINAL_TIMEOUT",
        ("snapshots.final_timeout",),
        "seconds allowed for the final snapshots on SIGTERM; keep it below the orchestrator's grace period",
        "SEC",
        parse.number(float),
    ),
    Option(
        "--request-timeout",
        "LLAMA_SIDECAR_REQUEST_TIMEOUT",
        ("upstream.request_timeout",),
        "timeout of polling calls, seconds",
        "SEC",
        parse.number(float),
    ),
    Option(
        "--action-timeout",
        "LLAMA_SIDECAR_ACTION_TIMEOUT",
        ("upstream.action_timeout",),
        "timeout of one save or restore call, seconds",
        "SEC",
        parse.number(float),
    ),
    Option(
        "--router",
        "LLAMA_SIDECAR_ROUTER",
        ("upstream.router",),
        "llama-server runs in router mode (--models-dir or --models-preset): watch, save and restore each "
        "model on its own, never loading one; snapshot files carry the model's name. Unset: follow the server "
        "(a router's /props says role router); --no-router forces plain mode",
        convert=parse.switch,
        switch=True,
    ),
    PROXY_LISTEN,
    Option(
        "--proxy-hold-seconds",
        "LLAMA_SIDECAR_PROXY_HOLD_SECONDS",
        ("proxy.hold_seconds",),
        "longest a completion request waits at the proxy for llama-server to be back and restored; "
        "then 503 with Retry-After (also the longest a routed request is held for a slot while every slot "
        "reads busy; then it goes unpinned)",
        "SEC",
        parse.number(float),
    ),
    Option(
        "--proxy-max-body-bytes",
        "LLAMA_SIDECAR_PROXY_MAX_BODY_BYTES",
        ("proxy.max_body_bytes",),
        "largest request body the proxy accepts; 413 above it",
        "N",
        parse.number(int),
    ),
    SERVER_CACHE_RAM,
    Option(
        "--no-proxy-prefix-header",
        "LLAMA_SIDECAR_NO_PROXY_PREFIX_HEADER",
        ("proxy.prefix_header",),
        "leave out the X-Llama-Sidecar-Prefix response header the proxy adds to each routed completion "
        "(where its prompt's prefix came from: slot, library, shared or cold, and the tokens restored for it)",
        convert=parse.switch,
        check=lambda off: not off,
        switch=True,
    ),
    Option(
        "--proxy-max-inflight-body-bytes",
        "LLAMA_SIDECAR_PROXY_MAX_INFLIGHT_BODY_BYTES",
        ("proxy.max_inflight_body_bytes",),
        "bytes of request bodies the proxy holds at once, all clients together (a body is held until its "
        "request ends, for a replay after a crash); a request that would go over gets a 503 with "
        "Retry-After, so memory stays bounded whatever clients send",
        "N",
        parse.number(int),
    ),
    Option(
        "--proxy-body-timeout",
        "LLAMA_SIDECAR_PROXY_BODY_TIMEOUT",
        ("proxy.body_timeout",),
        "seconds a request body may take to arrive in full; a client that stalls mid-body gets a 408 and "
        "its connection is closed",
        "SEC",
        parse.number(float),
    ),
    Option(
        "--proxy-max-connections",
        "LLAMA_SIDECAR_PROXY_MAX_CONNECTIONS",
        ("proxy.max_connections",),
        "client connections the proxy keeps open at once; one more is answered 503 (JSON) and closed. "
        "The sidecar raises its file-descriptor limit to 2 per connection plus 256 where the hard limit "
        "allows, and takes fewer connections (with a warning) where it does not",
        "N",
        parse.number(int),
    ),
    SHARED_STORE,
    Option(
        "--agent-check-listen",
        "LLAMA_SIDECAR_AGENT_CHECK_LISTEN",
        ("server.agent_host", "server.agent_port"),
        "HOST:PORT of a TCP port answering HAProxy's agent check (agent-check, agent-port on a server line): "
        "'down' while llama-server is down, 'up drain' while a restore round runs or the slot dir is below "
        "--min-free-bytes, else 'ready up N%' (see docs/nodes.md) (default: off)",
        "HOST:PORT",
        check=parse.agent_listen,
    ),
    Option(
        "--log-format",
        "LLAMA_SIDECAR_LOG_FORMAT",
        ("logs.format",),
        "json, console, or auto (console on a terminal)",
        choices=logs.FORMATS,
    ),
    Option(
        "--log-level",
        "LLAMA_SIDECAR_LOG_LEVEL",
        ("logs.level",),
        "how much to log",
        choices=("debug", "info", "warning", "error"),
    ),
)


def add(parser: argparse.ArgumentParser, options: Sequence[Option]) -> None:
    """Add ``options`` to ``parser`` with the default None, their help naming default and variable."""
    for option in options:
        text = f"{option.help}{_shown_default(option)} [{option.env}]".replace("%", "%%")
        if option.switch and option.flag.startswith("--no-"):
            # argparse's BooleanOptionalAction reads a flag spelt --no-X as its own negative form (False)
            parser.add_argument(option.flag, action="store_const", const=True, default=None, help=text)
        elif option.switch:
            parser.add_argument(option.flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            parser.add_argument(
                option.flag,
                default=None,
                type=option.convert,
                choices=option.choices,
                metavar=option.metavar,
                help=text,
            )


class Source(enum.IntEnum):
    ENV = 1
    FLAG = 2


def raw_value(ns: argparse.Namespace, option: Option) -> tuple[Any, Source] | None:
    """The option's parsed value and where it came from; None when neither flag nor variable is set.

    An empty variable counts as unset (``LLAMA_API_KEY=`` in a Compose file means no key).
    """
    parsed = getattr(ns, option.dest, None)
    if parsed is not None:
        return parsed, Source.FLAG
    text = os.environ.get(option.env, "")
    if not text:
        return None
    try:
        parsed = option.convert(text)
    except argparse.ArgumentTypeError as exc:
        raise errors.ConfigError(f"{option.env}={text!r} is not valid for {option.flag}: {exc}") from None
    if option.choices is not None and parsed not in option.choices:
        raise errors.ConfigError(f"{option.env}={text!r}: {option.flag} is one of {', '.join(option.choices)}")
    return parsed, Source.ENV


def checked_value(ns: argparse.Namespace, option: Option) -> Any:
    """The option's value after its check, or None."""
    found = raw_value(ns, option)
    if found is None:
        return None
    return option.check(found[0]) if option.check is not None else found[0]


PENDING_SLOT_DIR = Path("/")
"""The slot dir of launcher-mode settings until the launcher picks it (see ``settings_from``)."""


def settings_from(ns: argparse.Namespace, *, launching: bool = False) -> config.Settings:
    """Settings of ``run``: each field from its flag, else its variable, else config.py's default.

    Two options that set the same field (``--api-key`` and ``--api-key-file``) may not both be
    given at the same level; a flag wins over a variable. ``launching``: launcher mode, where the
    slot dir may be left to the launcher (:data:`PENDING_SLOT_DIR` until it is picked).
    """
    winners: dict[tuple[str, ...], tuple[Source, Option, Any]] = {}
    for option in OPTIONS:
        found = raw_value(ns, option)
        if found is None:
            continue
        parsed, source = found
        before = winners.get(option.fields)
        if before is not None and before[0] == source:
            named = (before[1].flag, option.flag) if source is Source.FLAG else (before[1].env, option.env)
            raise errors.ConfigError(f"{named[0]} and {named[1]} are both set: give one of them")
        if before is None or source > before[0]:
            winners[option.fields] = (source, option, parsed)
    groups: dict[str, dict[str, Any]] = {name: {} for name in _GROUPS}
    for fields, (_, option, parsed) in winners.items():
        checked = option.check(parsed) if option.check is not None else parsed
        if checked is None:
            continue
        for field, part in zip(fields, checked if len(fields) > 1 else (checked,), strict=True):
            group, name = field.split(".")
            groups[group][name] = part
    if "slot_dir" not in groups["snapshots"]:
        if not launching:
            raise errors.ConfigError(
                f"{SLOT_DIR.flag} (or {SLOT_DIR.env}) is required beside a llama-server started elsewhere: its "
                "--slot-save-path; or let the sidecar start it: llama-kv-sidecar run -- llama-server ARGS..."
            )
        groups["snapshots"]["slot_dir"] = PENDING_SLOT_DIR
    settings = config.Settings(**{name: _GROUPS[name](**fields) for name, fields in groups.items()})
    if settings.server.status_requires_token and not settings.server.admin_token:
        raise errors.ConfigError(
            "--status-requires-token needs an admin token: set --admin-token-file (or --admin-token)"
        )
    if settings.upstream.router and settings.shared.location is not None:
        raise errors.ConfigError(
            "--shared-store is not offered with --router: snapshots are shared between plain llama-servers"
            " only; drop one of the two"
        )
    return settings
