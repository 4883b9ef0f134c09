"""Command line: ``llama-kv-sidecar run | ls | verify | gc``.

``run [options] -- llama-server ARGS...`` is launcher mode: what follows
``--`` is the llama-server command the sidecar starts and supervises
(:mod:`sidecar.launch`); without ``--`` the sidecar runs beside a server
started elsewhere.

Flags win over environment variables, which win over defaults (the table
of options is ``options``, read by ``parsing``). Parsing and validation happen here only; the
rest of the package receives a frozen ``config.Settings``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

import uvloop

import sidecar
from sidecar.app import run as app
from sidecar.cli import defaults, options, parsing, schema
from sidecar.core import errors, logs, memtune, outcomes, protocols
from sidecar.launch import places
from sidecar.shared import connect, gc
from sidecar.snapshots import dirlock, store, storeevents


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llama-kv-sidecar",
        description="Keeps llama-server's slot KV cache alive across restarts: snapshots idle slots "
        "to disk and restores them when the server comes back.",
        epilog="Flags win over environment variables (in brackets), which win over the defaults.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {sidecar.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser(
        "run",
        help="start llama-server behind the sidecar: run -- llama-server ARGS... (or beside one: run --server URL "
        "--slot-dir DIR)",
        usage="%(prog)s [options] [-- llama-server ARGS...]",
        description="With '--' and a llama-server command, as its launcher (the default, no other flag needed): "
        "the proxy takes llama-server's own address (its --host/--port, or 127.0.0.1:8080) and llama-server moves "
        "to a free local port; it saves into a RAM staging dir, the snapshots kept in the block store under "
        "--state-dir; the sidecar restarts it when it ends and stops it after the final snapshots. Without '--', "
        "beside a llama-server started elsewhere (--server, --slot-dir).",
    )
    parsing.add(run, schema.Command.RUN)

    ls = sub.add_parser(
        "ls",
        help="list the snapshots in a slot dir by conversation (short hash of its token chain; '-' when not "
        "indexed), slot, tokens, size and last use, most recent first",
    )
    parsing.add(ls, schema.Command.LS)
    verify = sub.add_parser("verify", help="re-hash every snapshot and report (and quarantine) bad ones")
    parsing.add(verify, schema.Command.VERIFY)
    collect = sub.add_parser(
        "gc",
        help="apply retention to the shared store: unpublish old snapshots, delete their objects after a grace period",
    )
    parsing.add(collect, schema.Command.GC)
    return parser


settings_from = parsing.settings_from


class _Listed(storeevents.Silent):
    """What ``ls`` tells of the store's findings: a bad file, on stderr."""

    def quarantined(self, file: str, reason: outcomes.SnapshotProblem, detail: str) -> None:
        print(f"bad: {file}: {reason}: {detail}", file=sys.stderr)


class _Verified(storeevents.Silent):
    """What ``verify`` tells of the store's findings, one line each; it keeps the bad files' names."""

    def __init__(self, *, dry_run: bool) -> None:
        self.action = "found" if dry_run else "quarantined"
        self.bad: list[str] = []

    def quarantined(self, file: str, reason: outcomes.SnapshotProblem, detail: str) -> None:
        self.bad.append(file)
        print(f"BAD {file}: {reason}: {detail} ({self.action})")

    def io_error(self, operation: outcomes.SlotDirOperation, name: str, error: str) -> None:
        print(f"ERROR {name}: {operation}: {error} (kept)")

    def newer_format(self, name: str, found: int) -> None:
        print(f"SKIP {name}: manifest format {found} is newer (kept)")


def _open_store(ns: argparse.Namespace, *, read_only: bool, events: storeevents.StoreEvents) -> store.SnapshotStore:
    slot_dir = parsing.checked_value(ns, options.SLOT_DIR)
    store_dir = parsing.checked_value(ns, options.STORE_DIR)
    if slot_dir is None:  # the snapshots of a sidecar run with the defaults: its state dir's
        state = parsing.checked_value(ns, options.STATE_DIR) or places.default_state_dir(os.environ).resolve()
        has_store = (state / places.STORE).is_dir()
        if store_dir is None and not has_store and not (state / places.SLOTS).is_dir():
            raise errors.ConfigError(
                f"no snapshots in the state dir {state}: give {options.STATE_DIR.flag} of the sidecar whose "
                f"snapshots to read, or its {options.SLOT_DIR.flag} (and {options.STORE_DIR.flag})"
            )
        if store_dir is None and has_store:
            store_dir = state / places.STORE  # else whole files in slots/ (a run with --whole-files)
        slot_dir = places.subdir(state, places.SLOTS)
    if store_dir is not None and not store_dir.is_dir():
        raise errors.ConfigError(f"store dir {store_dir} does not exist")
    snapshots = store.SnapshotStore(
        slot_dir, clock=protocols.SystemClock(), read_only=read_only, events=events, store_dir=store_dir
    )
    if not snapshots.staging.is_dir():
        raise errors.ConfigError(f"slot dir {snapshots.staging} does not exist")
    return snapshots


def _ls(ns: argparse.Namespace) -> int:
    snapshots = _open_store(ns, read_only=True, events=_Listed())
    snapshots.loader.scan(clean=False)
    found = snapshots.snapshots()
    if ns.model is not None:
        found = [m for m in found if m.model == ns.model]
    if ns.json:
        for m in found:
            print(m.to_json().replace("\n", "").replace("  ", ""))
        return 0
    print(f"{'conversation':<12}  {'slot':>4}  {'tokens':>7}  {'MB':>8}  {'last use (UTC)':<19}  file")
    for m in sorted(found, key=lambda m: -snapshots.last_used(m.file)):
        used = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(snapshots.last_used(m.file)))
        key = m.index.key if m.index is not None and m.index.key else "-"
        model = f"  (model {m.model})" if m.model is not None else ""
        print(f"{key:<12}  {m.slot:>4}  {m.tokens:>7}  {m.bytes / 1e6:>8.1f}  {used:<19}  {m.file}{model}")
    library = snapshots.library()
    print(
        f"{len(found)} snapshot(s) in {snapshots.dir}; {len(library)} in the conversation library "
        f"({sum(m.bytes for m in library) / 1e6:.1f} MB)"
    )
    if snapshots.blocks is not None:
        held = snapshots.blocks.usage()
        print(
            f"block store {snapshots.blocks.root}: {held.unique_bytes / 1e6:.1f} MB in {held.blocks} block(s) hold "
            f"{held.represented_bytes / 1e6:.1f} MB of snapshots"
        )
    return 0


def _verify(ns: argparse.Namespace) -> int:
    told = _Verified(dry_run=ns.dry_run)
    snapshots = _open_store(ns, read_only=ns.dry_run, events=told)
    bad = told.bad
    lock = dirlock.DirLock(snapshots.staging)
    store_lock = None if snapshots.blocks is None else dirlock.DirLock(snapshots.blocks.root, kind="store dir")
    if not ns.dry_run:
        lock.acquire()  # it quarantines: not beside a running sidecar's own checks
        if store_lock is not None:
            try:
                store_lock.acquire()
            except BaseException:
                lock.release()
                raise
    try:
        snapshots.loader.scan(clean=False)
        checked = snapshots.snapshots()
        unreadable = 0
        for m in checked:
            try:
                snapshots.curator.check(m)
                if snapshots.blocks is not None:  # rebuilt and checked against its checksum, then deleted
                    snapshots.staged.release_whole(snapshots.staged.whole_file(m), m)
                print(f"ok  {m.file} ({m.tokens} tokens, {m.bytes} bytes)")
            except errors.SnapshotError as exc:
                if exc.reason in outcomes.BAD_CONTENT:
                    snapshots.curator.quarantine(m.file, exc.reason, detail=str(exc))
                else:
                    unreadable += 1
    finally:
        lock.release()
        if store_lock is not None:
            store_lock.release()
    summary = {"checked": len(checked), "bad": len(bad)} | ({"unreadable": unreadable} if unreadable else {})
    print(json.dumps(summary))
    return 1 if bad or unreadable else 0


def _gc(ns: argparse.Namespace) -> int:
    where = parsing.checked_value(ns, options.SHARED_STORE)
    if where is None:
        raise errors.ConfigError(f"{options.SHARED_STORE.flag} (or {options.SHARED_STORE.env}) is required")

    async def collect() -> gc.Plan:
        objects = connect.open_store(where)
        try:
            return await gc.collect(
                objects,
                where.key_prefix,
                now=time.time(),
                max_age=ns.max_age,
                max_bytes=ns.max_bytes,
                grace=ns.grace,
                dry_run=ns.dry_run,
            )
        finally:
            await objects.close()

    try:
        done = uvloop.run(collect())
    except errors.SharedStoreError as exc:
        print(f"llama-kv-sidecar gc: {where.describe()}: {exc}", file=sys.stderr)
        return 1
    verb = "would " if ns.dry_run else ""
    for key in done.unpublish:
        print(f"{verb}unpublish {key}")
    for key in done.delete:
        print(f"{verb}delete {key}")
    print(
        json.dumps(
            {"unpublished": len(done.unpublish), "deleted": len(done.delete), "kept_bytes": done.kept_bytes}
            | ({"dry_run": True} if ns.dry_run else {})
            | ({"late": "the run passed its deadline; the rest is deleted by the next run"} if done.late else {})
        )
    )
    return 0


def _split(args: list[str]) -> tuple[list[str], list[str] | None]:
    """The sidecar's own arguments, and the llama-server command after the first ``--`` (None without one)."""
    if "--" not in args:
        return args, None
    at = args.index("--")
    return args[:at], args[at + 1 :]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, command = _split(list(sys.argv[1:] if argv is None else argv))
    ns = parser.parse_args(args)
    if command is not None and ns.command != "run":
        parser.error(f"'--' and a llama-server command follow 'run' only, not '{ns.command}'")
    try:
        if ns.command == "ls":
            return _ls(ns)
        if ns.command == "verify":
            return _verify(ns)
        if ns.command == "gc":
            return _gc(ns)
        given = parsing.settings_from(ns, launching=command is not None)
        with defaults.prepared(ns, given, command, os.environ) as done:
            settings = done.settings
            folding = logs.configure(fmt=settings.logs.format, level=settings.logs.level, secrets=settings.secrets())
            memtune.fix_mmap_threshold()  # freed slot-file buffers go back to the system (see memtune)
            # libuv's event loop: less CPU per proxied request than asyncio's own
            uvloop.run(app.main(settings, folding=folding, launch=done.launch))
    except errors.ConfigError as exc:
        print(f"llama-kv-sidecar: error: {exc}", file=sys.stderr)
        return 2
    except errors.ServerNotStarted as exc:
        print(f"llama-kv-sidecar: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
