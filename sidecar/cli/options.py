"""The options of every command as one table: flag, environment variable, settings field, help, commands.

Each row of :data:`TABLE` is a ``schema.Option``: its flag, the environment variable that stands in
for it (run's options), the ``config.Settings`` field(s) it sets, its help, and the commands that
take it (``run``, ``ls``, ``verify``, ``gc``). A setting's default is written once, in ``config.py``:
the row reads it from there (``schema.Option.default``); a command's own flag (``gc --grace``) that
sets no settings field carries its default here. The parser is built from this table and read back
by :mod:`sidecar.cli.parsing`; docs/configuration.md and the unit tests are held to it.
"""

from __future__ import annotations

import os
from pathlib import Path

from sidecar.cli import schema, toolflags
from sidecar.core import location, logs, parse
from sidecar.shared import connect

STORES = frozenset({schema.Command.RUN, schema.Command.LS, schema.Command.VERIFY})
"""The commands that open the snapshots: ``run``, and ``ls`` and ``verify`` beside it."""

SLOT_DIR = schema.Option(
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
    commands=STORES,
)
STORE_DIR = schema.Option(
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
    commands=STORES,
)
SHARED_STORE = schema.Option(
    "--shared-store",
    "LLAMA_SIDECAR_SHARED_STORE",
    ("shared.location",),
    "s3://BUCKET/PREFIX or file:///PATH: upload committed snapshots there in the background and fetch "
    "other nodes' snapshots into empty slots; S3 endpoint and keys come from AWS_ENDPOINT_URL_S3 "
    "(or AWS_ENDPOINT_URL), AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION; s3:// needs the S3 client: "
    "pip install 'llama-kv-sidecar[s3]' (default: off)",
    "URL",
    check=lambda url: connect.require_client(location.parse(url, os.environ)),
    commands=frozenset({schema.Command.RUN, schema.Command.GC}),
)

STATE_DIR = schema.Option(
    "--state-dir",
    "LLAMA_SIDECAR_STATE_DIR",
    ("launch.state_dir",),
    "where the block store (store/) and, when no tmpfs has room, the staging dir (slots/) live; created 0700 "
    "when missing (its parent must exist); one sidecar per state dir (default: $XDG_STATE_HOME/llama-kv-sidecar, "
    "else ~/.local/state/llama-kv-sidecar)",
    metavar="DIR",
    convert=Path,
    check=Path.resolve,
    commands=STORES,
)
NO_PROXY = schema.Option(
    "--no-proxy",
    "LLAMA_SIDECAR_NO_PROXY",
    ("launch.proxy",),
    "launcher mode: run beside llama-server on its own address instead of putting the proxy there (clients "
    "then race a restore after a crash, and there is no conversation library)",
    convert=parse.switch,
    check=lambda off: not off,
    switch=True,
)
WHOLE_FILES = schema.Option(
    "--whole-files",
    "LLAMA_SIDECAR_WHOLE_FILES",
    ("launch.whole_files",),
    "one whole file per snapshot in the slot dir instead of the block store (every save rewrites the whole "
    "slot, every conversation keeps a whole copy of what it shares)",
    convert=parse.switch,
    switch=True,
)

PROXY_LISTEN = schema.Option(
    "--proxy-listen",
    "LLAMA_SIDECAR_PROXY_LISTEN",
    ("proxy.host", "proxy.port"),
    "HOST:PORT of the reverse proxy in front of llama-server; clients that use it wait while llama-server "
    "restarts and its slots are restored instead of failing or re-prefilling (default: in launcher mode, "
    "llama-server's own --host/--port, which move to a private port; beside a server started elsewhere, off)",
    "HOST:PORT",
    check=parse.proxy_listen,
)

SERVER_CACHE_RAM = schema.Option(
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

SERVER = schema.Option(
    "--server",
    "LLAMA_SIDECAR_SERVER",
    ("upstream.url",),
    "llama-server base URL (not with '-- llama-server ARGS': the launcher points the sidecar at the server it starts)",
    "URL",
    check=parse.url,
)
OPTIONS: tuple[schema.Option, ...] = (
    SERVER,
    STATE_DIR,
    NO_PROXY,
    WHOLE_FILES,
    SLOT_DIR,
    STORE_DIR,
    schema.Option(
        "--listen",
        "LLAMA_SIDECAR_LISTEN",
        ("server.host", "server.port"),
        "HOST:PORT for /metrics, /healthz, /readyz, /status (use 0.0.0.0:9464 in a container)",
        "HOST:PORT",
        check=parse.listen,
    ),
    schema.Option(
        "--poll-interval",
        "LLAMA_SIDECAR_POLL_INTERVAL",
        ("poll.interval",),
        "seconds between polls while the server is up",
        "SEC",
        parse.number(float),
    ),
    schema.Option(
        "--idle-seconds",
        "LLAMA_SIDECAR_IDLE_SECONDS",
        ("snapshots.idle_seconds",),
        "save a slot once it has been idle this many seconds after a change",
        "SEC",
        parse.number(float, zero_ok=True),
    ),
    schema.Option(
        "--snapshot-interval",
        "LLAMA_SIDECAR_SNAPSHOT_INTERVAL",
        ("snapshots.interval",),
        "save a changed slot at least this often, in seconds, even if it never stays idle --idle-seconds long",
        "SEC",
        parse.number(float),
    ),
    schema.Option(
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
    schema.Option(
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
    schema.Option(
        "--min-tokens",
        "LLAMA_SIDECAR_MIN_TOKENS",
        ("snapshots.min_tokens",),
        "do not save slots holding fewer tokens",
        "N",
        parse.number(int, zero_ok=True),
    ),
    schema.Option(
        "--api-key",
        "LLAMA_API_KEY",
        ("upstream.api_key", "upstream.keys"),
        "llama-server's --api-key, sent as a Bearer token, never logged; of a comma-separated list "
        "(key rotation) the first key is sent, and the proxy refuses clients whose key is none of them and keeps "
        "each key's conversations apart; prefer --api-key-file: flags show in the process list",
        "KEY",
        check=parse.first_key,
    ),
    schema.Option(
        "--api-key-file",
        "LLAMA_API_KEY_FILE",
        ("upstream.api_key", "upstream.keys"),
        "read the API keys from this file instead: llama-server's --api-key-file format, one key per line, "
        "# for comments; the first key is sent; a '# pool: NAME' line puts the keys after it in one pool, whose "
        "keys share their conversations through the proxy",
        "FILE",
        check=parse.key_file,
    ),
    schema.Option(
        "--admin-token",
        "LLAMA_SIDECAR_ADMIN_TOKEN",
        ("server.admin_token",),
        "enables POST /snapshot and /restore for callers sending it as a Bearer token; at least 16 characters, "
        "no surrounding whitespace; prefer --admin-token-file: flags show in the process list",
        "TOKEN",
        check=parse.admin_token,
    ),
    schema.Option(
        "--admin-token-file",
        "LLAMA_SIDECAR_ADMIN_TOKEN_FILE",
        ("server.admin_token",),
        "read the admin token from this file instead (a trailing newline is ignored; the same rules)",
        "FILE",
        check=parse.token_file,
    ),
    schema.Option(
        "--status-requires-token",
        "LLAMA_SIDECAR_STATUS_REQUIRES_TOKEN",
        ("server.status_requires_token",),
        "GET /status answers only callers sending the admin token (it lists slots, snapshots and the model path)",
        convert=parse.switch,
        switch=True,
    ),
    schema.Option(
        "--keep-per-slot",
        "LLAMA_SIDECAR_KEEP_PER_SLOT",
        ("snapshots.keep_per_slot",),
        "a snapshot is deleted once N newer snapshots extend its tokens (unindexed ones: the newest N per slot kept)",
        "N",
        parse.number(int),
    ),
    schema.Option(
        "--max-bytes",
        "LLAMA_SIDECAR_MAX_BYTES",
        ("snapshots.max_bytes",),
        "cap on all snapshots together, in bytes; 0 = no cap; a slot's newest snapshot is never deleted",
        "N",
        parse.number(int, zero_ok=True),
    ),
    schema.Option(
        "--max-age",
        "LLAMA_SIDECAR_MAX_AGE",
        ("snapshots.max_age",),
        "delete snapshots older than this many seconds, except a slot's newest; 0 = no limit",
        "SEC",
        parse.number(float, zero_ok=True),
    ),
    schema.Option(
        "--min-free-bytes",
        "LLAMA_SIDECAR_MIN_FREE_BYTES",
        ("snapshots.min_free_bytes",),
        "free space kept on the disk the snapshots live on (the slot dir's, or with --store-dir the store's), in "
        "bytes: a save that would go below it first deletes the least recently used snapshots not in use, just "
        "enough, and is skipped if that would not do",
        "N",
        parse.number(int, zero_ok=True),
    ),
    schema.Option(
        "--final-timeout",
        "LLAMA_SIDECAR_FINAL_TIMEOUT",
        ("snapshots.final_timeout",),
        "seconds allowed for the final snapshots on SIGTERM; keep it below the orchestrator's grace period",
        "SEC",
        parse.number(float),
    ),
    schema.Option(
        "--request-timeout",
        "LLAMA_SIDECAR_REQUEST_TIMEOUT",
        ("upstream.request_timeout",),
        "timeout of polling calls, seconds",
        "SEC",
        parse.number(float),
    ),
    schema.Option(
        "--action-timeout",
        "LLAMA_SIDECAR_ACTION_TIMEOUT",
        ("upstream.action_timeout",),
        "timeout of one save or restore call, seconds",
        "SEC",
        parse.number(float),
    ),
    schema.Option(
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
    schema.Option(
        "--proxy-hold-seconds",
        "LLAMA_SIDECAR_PROXY_HOLD_SECONDS",
        ("proxy.hold_seconds",),
        "longest a completion request waits at the proxy for llama-server to be back and restored; "
        "then 503 with Retry-After",
        "SEC",
        parse.number(float),
    ),
    schema.Option(
        "--proxy-max-body-bytes",
        "LLAMA_SIDECAR_PROXY_MAX_BODY_BYTES",
        ("proxy.max_body_bytes",),
        "largest request body the proxy accepts; 413 above it",
        "N",
        parse.number(int),
    ),
    SERVER_CACHE_RAM,
    schema.Option(
        "--no-proxy-prefix-header",
        "LLAMA_SIDECAR_NO_PROXY_PREFIX_HEADER",
        ("proxy.prefix_header",),
        "leave out the X-Llama-Sidecar-Prefix response header the proxy adds to each routed completion "
        "(where its prompt's prefix came from: slot, library, shared or cold, and the tokens restored for it)",
        convert=parse.switch,
        check=lambda off: not off,
        switch=True,
    ),
    schema.Option(
        "--proxy-max-inflight-body-bytes",
        "LLAMA_SIDECAR_PROXY_MAX_INFLIGHT_BODY_BYTES",
        ("proxy.max_inflight_body_bytes",),
        "bytes of request bodies the proxy holds at once, all clients together (a body is held until its "
        "request ends, for a replay after a crash); a request that would go over gets a 503 with "
        "Retry-After, so memory stays bounded whatever clients send",
        "N",
        parse.number(int),
    ),
    schema.Option(
        "--proxy-body-timeout",
        "LLAMA_SIDECAR_PROXY_BODY_TIMEOUT",
        ("proxy.body_timeout",),
        "seconds a request body may take to arrive in full; a client that stalls mid-body gets a 408 and "
        "its connection is closed",
        "SEC",
        parse.number(float),
    ),
    schema.Option(
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
    schema.Option(
        "--agent-check-listen",
        "LLAMA_SIDECAR_AGENT_CHECK_LISTEN",
        ("server.agent_host", "server.agent_port"),
        "HOST:PORT of a TCP port answering HAProxy's agent check (agent-check, agent-port on a server line): "
        "'down' while llama-server is down, 'up drain' while a restore round runs or the slot dir is below "
        "--min-free-bytes, else 'ready up N%' (see docs/nodes.md) (default: off)",
        "HOST:PORT",
        check=parse.agent_listen,
    ),
    schema.Option(
        "--log-format",
        "LLAMA_SIDECAR_LOG_FORMAT",
        ("logs.format",),
        "json, console, or auto (console on a terminal)",
        choices=logs.FORMATS,
    ),
    schema.Option(
        "--log-level",
        "LLAMA_SIDECAR_LOG_LEVEL",
        ("logs.level",),
        "how much to log",
        choices=("debug", "info", "warning", "error"),
    ),
)
"""The options of ``run``: each sets a settings field, and an environment variable stands in for it."""


TABLE: tuple[schema.Option, ...] = OPTIONS + toolflags.OWN
"""Every option of every command, in the order each command's help lists them."""


def of(command: schema.Command) -> tuple[schema.Option, ...]:
    """The options ``command`` takes, in the table's order."""
    return tuple(option for option in TABLE if command in option.commands)
