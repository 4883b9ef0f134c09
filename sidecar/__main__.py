"""Command line: ``llama-kv-sidecar run | ls | verify``.

Flags win over environment variables, which win over defaults. Parsing and
validation happen here only; the rest of the package receives a frozen
``config.Settings``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import sidecar
from sidecar import app, config, errors, logs, store

_ENV = {
    "server": "LLAMA_SIDECAR_SERVER",
    "slot_dir": "LLAMA_SIDECAR_SLOT_DIR",
    "listen": "LLAMA_SIDECAR_LISTEN",
    "poll_interval": "LLAMA_SIDECAR_POLL_INTERVAL",
    "idle_seconds": "LLAMA_SIDECAR_IDLE_SECONDS",
    "snapshot_interval": "LLAMA_SIDECAR_SNAPSHOT_INTERVAL",
    "min_tokens": "LLAMA_SIDECAR_MIN_TOKENS",
    "api_key": "LLAMA_API_KEY",
    "admin_token": "LLAMA_SIDECAR_ADMIN_TOKEN",
    "keep_per_slot": "LLAMA_SIDECAR_KEEP_PER_SLOT",
    "max_bytes": "LLAMA_SIDECAR_MAX_BYTES",
    "max_age": "LLAMA_SIDECAR_MAX_AGE",
    "min_free_bytes": "LLAMA_SIDECAR_MIN_FREE_BYTES",
    "final_timeout": "LLAMA_SIDECAR_FINAL_TIMEOUT",
    "request_timeout": "LLAMA_SIDECAR_REQUEST_TIMEOUT",
    "action_timeout": "LLAMA_SIDECAR_ACTION_TIMEOUT",
    "log_format": "LLAMA_SIDECAR_LOG_FORMAT",
    "log_level": "LLAMA_SIDECAR_LOG_LEVEL",
}


def _positive(kind: Callable[[str], Any], *, zero_ok: bool = False) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if value < 0 or (value == 0 and not zero_ok):
            raise argparse.ArgumentTypeError(f"{text!r} must be {'>= 0' if zero_ok else '> 0'}")
        return value

    parse.__name__ = kind.__name__
    return parse


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(_ENV[name], default)


def _slot_dir_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--slot-dir",
        default=_env("slot_dir"),
        type=Path,
        help=f"snapshot directory: the same directory llama-server was given as --slot-save-path [{_ENV['slot_dir']}]",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llama-kv-sidecar",
        description="Keeps llama-server's slot KV cache alive across restarts: snapshots idle slots "
        "to disk and restores them when the server comes back.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {sidecar.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the sidecar next to one llama-server")
    run.add_argument(
        "--server",
        default=_env("server", "http://127.0.0.1:8080"),
        help=f"llama-server base URL (default %(default)s) [{_ENV['server']}]",
    )
    _slot_dir_arg(run)
    run.add_argument(
        "--listen",
        default=_env("listen", "127.0.0.1:9464"),
        help="HOST:PORT for /metrics, /healthz, /readyz, /status (default %(default)s; "
        f"use 0.0.0.0:9464 in a container) [{_ENV['listen']}]",
    )
    run.add_argument(
        "--poll-interval",
        type=_positive(float),
        default=_env("poll_interval", "1.0"),
        help=f"seconds between polls while the server is up (default %(default)s) [{_ENV['poll_interval']}]",
    )
    run.add_argument(
        "--idle-seconds",
        type=_positive(float, zero_ok=True),
        default=_env("idle_seconds", "2.0"),
        help="save a slot once it has been idle this long after a change "
        f"(default %(default)s) [{_ENV['idle_seconds']}]",
    )
    run.add_argument(
        "--snapshot-interval",
        type=_positive(float),
        default=_env("snapshot_interval", "300"),
        help="save a changed slot at least this often even if it never stays idle "
        f"--idle-seconds long (default %(default)s) [{_ENV['snapshot_interval']}]",
    )
    run.add_argument(
        "--min-tokens",
        type=_positive(int, zero_ok=True),
        default=_env("min_tokens", "256"),
        help=f"do not save slots holding fewer tokens (default %(default)s) [{_ENV['min_tokens']}]",
    )
    run.add_argument(
        "--api-key",
        default=_env("api_key"),
        help=f"llama-server's --api-key, sent as a Bearer token, never logged [{_ENV['api_key']}]",
    )
    run.add_argument(
        "--admin-token",
        default=_env("admin_token"),
        help=f"enables POST /snapshot and /restore for callers sending it as a Bearer token [{_ENV['admin_token']}]",
    )
    run.add_argument(
        "--keep-per-slot",
        type=_positive(int),
        default=_env("keep_per_slot", "2"),
        help=f"newest snapshots kept per slot (default %(default)s) [{_ENV['keep_per_slot']}]",
    )
    run.add_argument(
        "--max-bytes",
        type=_positive(int, zero_ok=True),
        default=_env("max_bytes", "0"),
        help="cap on all snapshots together, in bytes; 0 = no cap; a slot's newest snapshot "
        f"is never deleted (default %(default)s) [{_ENV['max_bytes']}]",
    )
    run.add_argument(
        "--max-age",
        type=_positive(float, zero_ok=True),
        default=_env("max_age", "0"),
        help="delete snapshots older than this many seconds, except a slot's newest; "
        f"0 = no limit (default %(default)s) [{_ENV['max_age']}]",
    )
    run.add_argument(
        "--min-free-bytes",
        type=_positive(int, zero_ok=True),
        default=_env("min_free_bytes", str(1 << 30)),
        help="skip saves that would leave less free space than this on the slot dir's "
        f"filesystem (default %(default)s) [{_ENV['min_free_bytes']}]",
    )
    run.add_argument(
        "--final-timeout",
        type=_positive(float),
        default=_env("final_timeout", "20"),
        help="seconds allowed for the final snapshots on SIGTERM; keep it below the "
        f"orchestrator's grace period (default %(default)s) [{_ENV['final_timeout']}]",
    )
    run.add_argument(
        "--request-timeout",
        type=_positive(float),
        default=_env("request_timeout", "5"),
        help=f"timeout of polling calls, seconds (default %(default)s) [{_ENV['request_timeout']}]",
    )
    run.add_argument(
        "--action-timeout",
        type=_positive(float),
        default=_env("action_timeout", "300"),
        help=f"timeout of one save or restore call, seconds (default %(default)s) [{_ENV['action_timeout']}]",
    )
    run.add_argument(
        "--log-format",
        choices=logs.FORMATS,
        default=_env("log_format", "auto"),
        help=f"json, console, or auto (console on a terminal) [{_ENV['log_format']}]",
    )
    run.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default=_env("log_level", "info"),
        help=f"(default %(default)s) [{_ENV['log_level']}]",
    )

    ls = sub.add_parser("ls", help="list the snapshots in a slot dir with their manifests")
    _slot_dir_arg(ls)
    ls.add_argument("--json", action="store_true", help="print the manifests as JSON lines")
    verify = sub.add_parser("verify", help="re-hash every snapshot and report (and quarantine) bad ones")
    _slot_dir_arg(verify)
    verify.add_argument("--dry-run", action="store_true", help="report bad files without quarantining them")
    return parser


def _listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise errors.ConfigError(f"--listen {text!r} is not HOST:PORT (for example 127.0.0.1:9464)")
    # An empty host (":9464") means every interface, as the user asked.
    return host.strip("[]") or "0.0.0.0", int(port)  # noqa: S104


def settings_from(ns: argparse.Namespace) -> config.Settings:
    url = urlsplit(ns.server)
    try:
        port_ok = url.port is None or url.port > 0
    except ValueError:
        port_ok = False
    if url.scheme not in ("http", "https") or not url.hostname or not port_ok:
        raise errors.ConfigError(
            f"--server {ns.server!r} is not an http(s) URL with a valid port, such as http://127.0.0.1:8080"
        )
    if ns.slot_dir is None:
        raise errors.ConfigError(f"--slot-dir (or {_ENV['slot_dir']}) is required: llama-server's --slot-save-path")
    host, port = _listen(ns.listen)
    return config.Settings(
        upstream=config.UpstreamSettings(
            url=ns.server,
            api_key=ns.api_key or None,
            request_timeout=float(ns.request_timeout),
            action_timeout=float(ns.action_timeout),
        ),
        poll=config.PollSettings(interval=float(ns.poll_interval)),
        snapshots=config.SnapshotSettings(
            slot_dir=Path(ns.slot_dir).resolve(),
            idle_seconds=float(ns.idle_seconds),
            interval=float(ns.snapshot_interval),
            min_tokens=int(ns.min_tokens),
            keep_per_slot=int(ns.keep_per_slot),
            max_bytes=int(ns.max_bytes),
            max_age=float(ns.max_age),
            min_free_bytes=int(ns.min_free_bytes),
            final_timeout=float(ns.final_timeout),
        ),
        server=config.ServerSettings(host=host, port=port, admin_token=ns.admin_token or None),
    )


def _open_store(ns: argparse.Namespace, *, read_only: bool) -> store.SnapshotStore:
    if ns.slot_dir is None:
        raise errors.ConfigError(f"--slot-dir (or {_ENV['slot_dir']}) is required")
    snaps = store.SnapshotStore(Path(ns.slot_dir).resolve(), clock=time.time, read_only=read_only)
    if not snaps.dir.is_dir():
        raise errors.ConfigError(f"slot dir {snaps.dir} does not exist")
    return snaps


def _ls(ns: argparse.Namespace) -> int:
    snaps = _open_store(ns, read_only=True)
    snaps.on_quarantine = lambda file, reason, detail: print(f"bad: {file}: {reason}: {detail}", file=sys.stderr)
    snaps.scan(clean=False)
    found = snaps.snapshots()
    if ns.json:
        for m in found:
            print(m.to_json().replace("\n", "").replace("  ", ""))
        return 0
    print(f"{'slot':>4}  {'tokens':>7}  {'MB':>8}  {'created (UTC)':<20}  file")
    for m in sorted(found, key=lambda m: (m.slot, -m.created)):
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(m.created))
        print(f"{m.slot:>4}  {m.tokens:>7}  {m.bytes / 1e6:>8.1f}  {created:<20}  {m.file}")
    print(f"{len(found)} snapshot(s) in {snaps.dir}")
    return 0


def _verify(ns: argparse.Namespace) -> int:
    snaps = _open_store(ns, read_only=ns.dry_run)
    action = "found" if ns.dry_run else "quarantined"
    bad: list[str] = []

    def report(file: str, reason: str, detail: str) -> None:
        bad.append(file)
        print(f"BAD {file}: {reason}: {detail} ({action})")

    snaps.on_quarantine = report
    snaps.scan(clean=False)
    checked = snaps.snapshots()
    for m in checked:
        try:
            snaps.verify(m)
            print(f"ok  {m.file} ({m.tokens} tokens, {m.bytes} bytes)")
        except errors.SnapshotError as exc:
            snaps.quarantine(m.file, exc.reason, detail=str(exc))
    print(json.dumps({"checked": len(checked), "bad": len(bad)}))
    return 1 if bad else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        if ns.command == "ls":
            return _ls(ns)
        if ns.command == "verify":
            return _verify(ns)
        settings = settings_from(ns)
        logs.configure(fmt=ns.log_format, level=ns.log_level)
        asyncio.run(app.main(settings))
    except errors.ConfigError as exc:
        print(f"llama-kv-sidecar: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
