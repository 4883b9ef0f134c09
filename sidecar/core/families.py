"""The metrics contract as one table: every family's name, type, labels and one-sentence help.

Each row is a :class:`Family` declared on :class:`Families`, in the order of
the exposition; :class:`sidecar.core.metrics.Metrics` builds the
prometheus-client objects from them against its registry. docs/metrics.md
explains each family at length; the unit tests hold the table, that page and
the deploy tests' synthetic page to each other. A label either lists every
value it takes (each series exists at zero from the start) or takes ids
(slots, models) whose series come and go with them.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, overload

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from sidecar.core import events, outcomes

NAMESPACE = "llama_sidecar"

M = TypeVar("M", Counter, Gauge, Histogram, Info)

FAST = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
HOLD = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
TRANSFER = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
RESTART = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass(frozen=True, slots=True)
class Label:
    name: str
    values: tuple[str, ...] | None = None
    """Every value the label takes, each series made at zero; None for ids (slots, models) made as they appear."""


def label(name: str, vocabulary: Iterable[enum.StrEnum]) -> Label:
    """A label whose values are a closed vocabulary (``sidecar.core.outcomes``)."""
    return Label(name, tuple(member.value for member in vocabulary))


SLOT = Label("slot")
MODEL = Label("model")
SNAPSHOT_RESULT = label("result", outcomes.SaveResult)
RESTORE_RESULT = label("result", outcomes.RestoreOutcome)
DIRECTION = label("direction", outcomes.Direction)
SAVED_BY = label("by", outcomes.SavedBy)


class Family(Generic[M]):
    """One family of the contract; on a built :class:`Families` object, its prometheus-client metric."""

    def __init__(
        self, kind: type[M], name: str, help_text: str, *labels: Label, buckets: tuple[float, ...] | None = None
    ) -> None:
        self.kind: type[M] = kind
        self.name = name
        """Without the ``llama_sidecar_`` prefix and, for a counter, the ``_total`` suffix."""
        self.help = help_text
        self.labels = labels
        self.buckets = buckets
        self.attr = ""

    def __set_name__(self, owner: type, attr: str) -> None:
        self.attr = attr

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Family[M]: ...
    @overload
    def __get__(self, obj: Families, owner: type | None = None) -> M: ...
    def __get__(self, obj: Families | None, owner: type | None = None) -> Family[M] | M:
        if obj is None:
            return self
        raise AttributeError(self.attr)  # not built on this object (a router model's view looks it up elsewhere)

    def build(self, registry: CollectorRegistry) -> M:
        """The metric in ``registry``, with a series at zero for every combination of listed label values."""
        extra: dict[str, Any] = {} if self.buckets is None else {"buckets": self.buckets}
        names = [each.name for each in self.labels]
        metric: M = self.kind(self.name, self.help, names, namespace=NAMESPACE, registry=registry, **extra)
        bounded = [each.values for each in self.labels if each.values is not None]
        if self.labels and len(bounded) == len(self.labels):
            for values in itertools.product(*bounded):
                metric.labels(*values)
        return metric


def counter(name: str, help_text: str, *labels: Label) -> Family[Counter]:
    return Family(Counter, name, help_text, *labels)


def gauge(name: str, help_text: str, *labels: Label) -> Family[Gauge]:
    return Family(Gauge, name, help_text, *labels)


def histogram(name: str, help_text: str, *labels: Label, buckets: tuple[float, ...]) -> Family[Histogram]:
    return Family(Histogram, name, help_text, *labels, buckets=buckets)


def info(name: str, help_text: str) -> Family[Info]:
    return Family(Info, name, help_text)


class Families:
    """Every family the sidecar exports, in the order of the exposition (help texts: one sentence each)."""

    # The server and the build
    build_info = info("build", "Version of llama-kv-sidecar that is running.")
    server_up = gauge("server_up", "1 while llama-server's /health answers ok, 0 while it is down or loading.")
    server_readable = gauge(
        "server_readable",
        "0 while llama-server refuses the sidecar's reads of /slots, /props or /metrics with 401/403, so nothing is "
        "saved or restored: give the sidecar the server's API key; 1 otherwise.",
    )
    model_memory = gauge(
        "model_memory_info",
        "1 for the memory kind of the served model, read from its GGUF header (swa_full: a sliding-window model "
        "on a server seen running with --swa-full; unknown: the file was not readable), 0 for the others.",
        label("memory", events.Memory),
    )
    server_restarts = counter("server_restarts", "llama-server process restarts detected by the sidecar.")
    server_exits = counter(
        "server_exits",
        "Launcher mode: ends of the llama-server the sidecar started, by cause; every cause but stopped is "
        "followed by a restart (the sidecar ends instead if the server never served).",
        label("cause", outcomes.ServerExit),
    )
    server_crash_loop = gauge(
        "server_crash_loop",
        "Launcher mode: 1 while the llama-server the sidecar started ends again and again before serving (it is "
        "still restarted; the log line server_crash_loop says why), 0 otherwise.",
    )

    # Saves
    snapshots = counter(
        "snapshots",
        "Slot snapshots attempted, by slot and result: ok (committed), failed (the save or its check failed), "
        "skipped (nothing worth saving, a busy slot, or a disk that refuses writes).",
        SLOT,
        SNAPSHOT_RESULT,
    )
    snapshot_duration = histogram(
        "snapshot_duration_seconds",
        "Seconds per committed snapshot: the server's save call plus the sidecar's size check, checksum and fdatasync.",
        buckets=FAST,
    )

    # Restores
    restores = counter(
        "restores",
        "Slot restore attempts, by slot and result; ok only when the server's answer says it restored every token "
        "of the snapshot.",
        SLOT,
        RESTORE_RESULT,
    )
    restore_duration = histogram(
        "restore_duration_seconds",
        "Seconds per successful restore: checksum check plus the server's restore call.",
        buckets=FAST,
    )
    restart_to_restore = histogram(
        "restart_to_restore_seconds",
        "Seconds from the restarted server first answering /health ok to a slot restored.",
        buckets=RESTART,
    )
    restored_tokens = counter("restored_tokens", "Tokens put back into slots by restores.", SLOT)
    restore_verifications = counter(
        "restore_verifications",
        "Restores judged by the slot's next task: effective (it reused at least half the restored tokens), "
        "ineffective (it re-prefilled), unverified (no figure of that slot's own).",
        label("outcome", outcomes.Verification),
    )
    prefill_saved_seconds = counter(
        "prefill_saved_seconds",
        "Estimated prefill seconds llama-server did not spend because a restore or a swap put the KV back, "
        "priced at the server's own prefill rate.",
        SAVED_BY,
    )
    prefill_saved_tokens = counter(
        "prefill_saved_tokens",
        "Prompt tokens behind prefill_saved_seconds_total: reused by a slot's next task after an effective "
        "restore or swap.",
        SAVED_BY,
    )

    # The slot dir
    disk_used = gauge("disk_used_bytes", "Bytes of all files in the slot dir (snapshots, temp, quarantine).")
    disk_free = gauge("disk_free_bytes", "Bytes free for unprivileged users on the slot dir's filesystem.")
    snapshot_files = gauge("snapshot_files", "Committed snapshots (with a manifest) in the slot dir.")
    gc_deleted = counter(
        "gc_deleted",
        "Snapshots deleted by retention, by reason: keep (--keep-per-slot), superseded (a newer snapshot of the "
        "same conversation holds it), bytes (--max-bytes), age (--max-age), space (the least recently used, "
        "so that a save fits above --min-free-bytes).",
        label("reason", outcomes.GcReason),
    )
    quarantined = counter(
        "snapshots_quarantined",
        "Snapshot files taken out of use and never restored, by reason: changed bytes, a wrong size, a bad or "
        "oversized manifest, or a name that is not a regular file.",
        label("reason", (p for p in outcomes.SnapshotProblem if p in outcomes.BAD_CONTENT)),
    )
    slot_dir_errors = counter(
        "slot_dir_errors",
        "I/O errors in the slot dir that retries did not clear, by operation; /readyz names the current problem.",
        label("operation", outcomes.SlotDirOperation),
    )
    last_snapshot = gauge("last_snapshot_timestamp_seconds", "Unix time of the newest committed snapshot.")
    unsaved_since = gauge(
        "slot_unsaved_since_timestamp_seconds",
        "Unix time of the oldest change to the slot's KV that no snapshot holds yet (lost if llama-server "
        "crashes now), 0 while every change is saved.",
        SLOT,
    )
    unsaved_reprefill = gauge(
        "slot_unsaved_reprefill_seconds",
        "Seconds llama-server would take to re-prefill the slot's tokens past its newest snapshot (lost if it "
        "crashes now), at its measured prefill rate; 0 while every change is saved or before a rate is measured.",
        SLOT,
    )
    save_expected_stall = gauge(
        "slot_save_expected_stall_seconds",
        "Seconds a save of the slot as it holds now is expected to stall every slot (its tokens at the seconds per "
        "token of the newest save, as llama-server timed it); 0 before a save was measured or while the slot is empty.",
        SLOT,
    )
    snapshots_held = counter(
        "snapshots_held",
        "Due saves held while another slot is processing, once per slot content and reason: hold (within "
        "--save-hold-seconds), cheap_tail (past it, the tail a crash would lose re-prefills faster than the save "
        "would stall every slot, and within --max-unsaved-seconds).",
        label("reason", outcomes.SaveHold),
    )
    snapshot_write_errors = counter(
        "snapshot_write_errors",
        "Saves whose commit the disk keeping the snapshots refused, by reason; later saves are skipped until it "
        "takes writes again: free space or fix its permissions.",
        label("reason", outcomes.StoreFault),
    )
    commits_pending = gauge(
        "snapshot_commits_pending",
        "Snapshots llama-server wrote whose commit waits, at most 60 s, for no slot to be processing; not "
        "restorable until committed.",
    )

    # The block store (--store-dir)
    store_written = counter(
        "store_written_bytes",
        "Bytes the block store (--store-dir) wrote, by kind: blocks (only those it did not hold), manifests.",
        label("kind", outcomes.StoreWrite),
    )
    store_deduplicated = counter(
        "store_deduplicated_bytes",
        "Bytes of saved slot files the block store did not write because it held their blocks already.",
    )
    store_unique = gauge(
        "store_unique_bytes", "Bytes of the blocks the block store holds, each stored once (0 without --store-dir)."
    )
    store_represented = gauge(
        "store_represented_bytes",
        "Bytes the block store's snapshots would take as whole files (0 without --store-dir).",
    )
    store_staged = gauge(
        "store_staged_bytes",
        "Bytes staged in the slot dir now: saves not ingested yet and snapshots rebuilt for restores "
        "(0 without --store-dir).",
    )
    staged_on_disk = counter(
        "store_staged_on_disk",
        "Saves and restores staged on the store's disk instead of the slot dir, by reason: no_room (the slot "
        "dir lacked room for the slot file).",
        label("reason", outcomes.StagingFallback),
    )
    restore_ahead = counter(
        "restore_ahead",
        "Snapshots rebuilt from the block store while llama-server loaded, ahead of its restore round, by "
        "outcome: used, unused (given back), skipped (no room: its restore rebuilt it).",
        label("outcome", outcomes.RestoreAhead),
    )

    # The proxy (--proxy-listen)
    proxy_requests = counter(
        "proxy_requests",
        "Requests through the proxy (--proxy-listen), by route (completion: waits at the restore gate; other) "
        "and outcome.",
        label("route", outcomes.Route),
        label("outcome", outcomes.ProxyOutcome),
    )
    proxy_hold = histogram(
        "proxy_hold_seconds",
        "Seconds a request waited at the restore gate while llama-server was down, loading or being restored, "
        "for requests that met it closed.",
        buckets=HOLD,
    )
    proxy_inflight = gauge(
        "proxy_inflight_requests", "Requests the proxy is handling now, those held at the gate included."
    )
    proxy_body_bytes = gauge(
        "proxy_body_bytes",
        "Bytes of request bodies the proxy holds now, all clients together (capped by "
        "--proxy-max-inflight-body-bytes).",
    )
    proxy_connections = gauge(
        "proxy_connections", "Client connections open to the proxy now (capped by --proxy-max-connections)."
    )
    proxy_connections_refused = counter(
        "proxy_connections_refused",
        "Client connections answered 503 and closed at once because --proxy-max-connections were open.",
    )
    proxy_held = gauge("proxy_held_requests", "Requests waiting at the restore gate now.")

    # The conversation library: routing, swaps, its size
    conversation_requests = counter(
        "conversation_requests",
        "Routed completion requests answered, by where their prompt's prefix came from as the answer shows "
        "(cold: prefilled from scratch).",
        label("source", outcomes.Source),
    )
    conversation_unrouted = counter(
        "conversation_unrouted",
        "Completion requests forwarded as they came without routing, by reason; llama-server picks their slot.",
        label("reason", outcomes.Unrouted),
    )
    conversation_unserved = counter(
        "conversation_unserved",
        "Routed completion requests that were not served, by reason: rejected (an error status), cut "
        "(llama-server went away mid-answer), cancelled (the client went away first).",
        label("reason", outcomes.Unserved),
    )
    library_prompt_bytes = counter(
        "library_prompt_bytes",
        "Bytes of prompt text the routing needed token ids for, by how it got them: asked (llama-server's "
        "/tokenize) or remembered (held from the conversation's earlier turns).",
        label("source", outcomes.PromptBytes),
    )
    library_routes = counter(
        "library_routes",
        "Completion requests the routing placed, by how: turn (it continues a slot's last conversation, seen from "
        "its body alone) or tokens (by the prompt's token ids).",
        label("by", outcomes.RouteBy),
    )
    library_slots_read_retries = counter(
        "library_slots_read_retries",
        "Reads of /slots on a routed request's path sent again after 0.5 s without an answer, by which read "
        "answered; a rising count means llama-server's HTTP threads stall: see its log.",
        label("answered", outcomes.SlotsRetry),
    )
    library_tokens = counter(
        "library_tokens",
        "Prompt tokens served from the library: of the prefix a swap put in a slot, those the request's answer "
        "shows reused.",
    )
    swap_duration = histogram(
        "swap_duration_seconds",
        "Seconds a swap took before its request was forwarded: the save of the slot's changed content plus the "
        "restore of the library snapshot.",
        buckets=FAST,
    )
    library_conversations = gauge(
        "library_conversations",
        "Snapshots in the library indexed by content (each a conversation, or a turn of one kept by --keep-per-slot).",
    )
    library_bytes = gauge("library_bytes", "Bytes of the snapshots in the library indexed by content.")
    ram_conversations = gauge(
        "library_ram_conversations",
        "Conversations the library counts on llama-server's RAM prompt cache to hold (at most "
        "--server-cache-ram-bytes of them; 0 after a restart).",
    )
    left_unsaved = histogram(
        "library_left_unsaved_reprefill_seconds",
        "Conversations that left their slot for llama-server's RAM prompt cache without a save, by the seconds a "
        "crash of the server would cost to re-prefill what no snapshot holds (at most --max-unsaved-seconds).",
        buckets=HOLD,
    )

    # The shared store (--shared-store)
    shared_bytes = counter(
        "shared_store_bytes",
        "Bytes of snapshots moved to (up) or from (down) the shared store (--shared-store).",
        DIRECTION,
    )
    shared_objects = counter(
        "shared_store_objects",
        "Snapshots uploaded to (up) or downloaded from (down) the shared store, but for those another node had "
        "uploaded already.",
        DIRECTION,
    )
    shared_block_bytes = counter(
        "shared_store_block_bytes",
        "Bytes of snapshot files moved to or from the shared store as blocks, by outcome: transferred (the "
        "blocks the other side lacked, and the recipe) or skipped (held there already).",
        DIRECTION,
        label("outcome", outcomes.BlockTransfer),
    )
    shared_transfer = histogram(
        "shared_store_transfer_seconds",
        "Seconds one snapshot took to upload (up) or download and verify (down).",
        DIRECTION,
        buckets=TRANSFER,
    )
    shared_errors = counter(
        "shared_store_errors",
        "Failed operations on the shared store, by operation; local snapshots and restores go on, and uploads "
        "are retried with backoff until the store answers.",
        label("operation", outcomes.SharedOperation),
    )
    shared_refused = counter(
        "shared_store_refused",
        "Objects of the shared store this node refused and never fetches again, by reason; their requests are "
        "prefilled instead.",
        label("reason", outcomes.SharedRefusal),
    )
    shared_pending = gauge(
        "shared_store_pending_uploads",
        "Committed snapshots waiting to be uploaded to the shared store (grows while it is down).",
    )

    # Router mode (--router): per model
    model_up = gauge(
        "model_up",
        "Router mode (--router): 1 while the router runs the model loaded (or asleep) and answers for it, 0 while "
        "it is unloaded or loading.",
        MODEL,
    )
    model_snapshots = counter(
        "model_snapshots", "Router mode (--router): snapshots_total by model and result.", MODEL, SNAPSHOT_RESULT
    )
    model_restores = counter(
        "model_restores", "Router mode (--router): restores_total by model and result.", MODEL, RESTORE_RESULT
    )


def declared() -> Iterator[Family[Any]]:
    """Every family of the table, in the order of the exposition."""
    for value in vars(Families).values():
        if isinstance(value, Family):
            yield value
