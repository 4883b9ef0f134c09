"""Every metric the sidecar exports, built against an injected registry.

Names, types and labels follow the project's metrics contract (prefix
``llama_sidecar_``). Labels take bounded values only: slot ids and a
handful of result words, each pre-initialised so no series is missing when
Prometheus first scrapes. llama-server's own counters are not re-exported:
scrape its /metrics directly.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from sidecar.core import events, outcomes

NAMESPACE = "llama_sidecar"
SNAPSHOT_RESULTS = tuple(r.value for r in outcomes.SaveResult)
RESTORE_RESULTS = tuple(r.value for r in outcomes.RestoreOutcome)
VERIFY_OUTCOMES = tuple(v.value for v in outcomes.Verification)
GC_REASONS = tuple(r.value for r in outcomes.GcReason)
CONVERSATION_SOURCES = tuple(s.value for s in outcomes.Source)
UNROUTED_REASONS = tuple(r.value for r in outcomes.Unrouted)
UNSERVED_REASONS = tuple(r.value for r in outcomes.Unserved)
PROMPT_BYTE_SOURCES = tuple(s.value for s in outcomes.PromptBytes)
ROUTE_METHODS = tuple(b.value for b in outcomes.RouteBy)
SLOTS_RETRY_ANSWERS = tuple(a.value for a in outcomes.SlotsRetry)
QUARANTINE_REASONS = tuple(p.value for p in outcomes.SnapshotProblem if p in outcomes.BAD_CONTENT)
SLOT_DIR_OPERATIONS = tuple(o.value for o in outcomes.SlotDirOperation)
SHARED_DIRECTIONS = tuple(d.value for d in outcomes.Direction)
SHARED_OPERATIONS = tuple(o.value for o in outcomes.SharedOperation)
SHARED_REFUSALS = tuple(r.value for r in outcomes.SharedRefusal)
SERVER_EXIT_CAUSES = tuple(c.value for c in outcomes.ServerExit)

_FAST = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_HOLD = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
_TRANSFER = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_RESTART = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Metrics:
    def __init__(self, registry: CollectorRegistry, *, version: str) -> None:
        self._server_families(registry, version)
        self._snapshot_families(registry)
        self._restore_families(registry)
        self._slot_dir_families(registry)
        self._block_store_families(registry)
        self._proxy_families(registry)
        self._library_families(registry)
        self._shared_families(registry)
        self._model_families(registry)
        self._preinitialise()

    def _server_families(self, registry: CollectorRegistry, version: str) -> None:
        """The server and the build: up, readable, restarts."""
        self.build_info = Info(
            "build", "Version of llama-kv-sidecar that is running.", namespace=NAMESPACE, registry=registry
        )
        self.build_info.info({"version": version})
        self.server_up = Gauge(
            "server_up",
            "1 while llama-server's /health answers ok, 0 while it is down or loading.",
            namespace=NAMESPACE,
            registry=registry,
        )
        self.server_readable = Gauge(
            "server_readable",
            "0 while llama-server answers /health but refuses the sidecar's reads of /slots, /props or "
            "/metrics with 401/403 (the sidecar lacks one of its API keys: nothing is saved or restored); "
            "1 otherwise.",
            namespace=NAMESPACE,
            registry=registry,
        )
        self.server_readable.set(1)
        self.model_memory = Gauge(
            "model_memory_info",
            "1 for the memory kind of the model llama-server serves, read from its GGUF header: attention, "
            "swa (sliding window), recurrent, hybrid (recurrent layers beside attention: snapshots end at "
            "the prompt's boundary and match to the token), unknown (the file was not readable).",
            ["memory"],
            namespace=NAMESPACE,
            registry=registry,
        )
        for kind in events.Memory:
            self.model_memory.labels(kind.value)
        self.server_restarts = Counter(
            "server_restarts",
            "llama-server process restarts detected by the sidecar.",
            namespace=NAMESPACE,
            registry=registry,
        )
        self.server_exits = Counter(
            "server_exits",
            "Launcher mode (run ... -- llama-server ARGS): ends of the llama-server the sidecar started, by cause: "
            "stopped (by the sidecar, at its shutdown), exited (status 0), failed (a non-zero status), killed "
            "(a signal: OOM killer, kill -9, a crash), not_started (the program could not be run). Every cause "
            "but stopped is followed by a restart, until a crash loop.",
            ["cause"],
            namespace=NAMESPACE,
            registry=registry,
        )
        for cause in SERVER_EXIT_CAUSES:
            self.server_exits.labels(cause)
        self.server_crash_loop = Gauge(
            "server_crash_loop",
            "Launcher mode: 1 once the llama-server the sidecar started ended too often in a short time (a crash "
            "loop) and is no longer restarted; the log line server_crash_loop says why. 0 otherwise.",
            namespace=NAMESPACE,
            registry=registry,
        )

    def _snapshot_families(self, registry: CollectorRegistry) -> None:
        """Saves: results and durations."""
        self.snapshots = Counter(
            "snapshots",
            "Slot snapshots attempted, by slot and result: ok (committed), failed (save or check "
            "failed), skipped (below --min-tokens, empty slot, disk below the free-space floor, or the slot "
            "started processing a request just before the save: nothing is sent to a busy slot).",
            ["slot", "result"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.snapshot_duration = Histogram(
            "snapshot_duration_seconds",
            "Seconds per successful snapshot: the server's save call plus the sidecar's size check, "
            "checksum and fdatasync (not the wait of a commit left until no slot is processing).",
            buckets=_FAST,
            namespace=NAMESPACE,
            registry=registry,
        )

    def _restore_families(self, registry: CollectorRegistry) -> None:
        """Restores: results, durations, restart to restore, verification."""
        self.restores = Counter(
            "restores",
            "Slot restore attempts, by slot and result: ok, failed (the server refused the file), "
            "incompatible (no snapshot fits this server), no_snapshot, slot_busy (the slot already "
            "held a user's tokens or was processing), raced (a request ran on the slot while the restore "
            "call was in flight: the server restored after it, replacing that request's KV), "
            "ineffective, unverified (a sliding-window model: counted once the slot's next request shows "
            "whether the server reused it, ok or ineffective; unverified if nothing decided). ok only when "
            "the server's answer says it restored every token of the snapshot.",
            ["slot", "result"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.restore_duration = Histogram(
            "restore_duration_seconds",
            "Seconds per successful restore: checksum check plus the server's restore call.",
            buckets=_FAST,
            namespace=NAMESPACE,
            registry=registry,
        )
        self.restart_to_restore = Histogram(
            "restart_to_restore_seconds",
            "Seconds from the restarted server first answering /health ok to a slot restored.",
            buckets=_RESTART,
            namespace=NAMESPACE,
            registry=registry,
        )
        self.restored_tokens = Counter(
            "restored_tokens",
            "Tokens put back into slots by restores.",
            ["slot"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.restore_verifications = Counter(
            "restore_verifications",
            "Restores checked against the slot's next task: effective (the server reused at least half the "
            "restored tokens, as that request's own answer says through the proxy, or as "
            "llamacpp:prompt_tokens_cached_total grew while no other slot ran a task), ineffective (it "
            "re-prefilled), unverified (no figure of that slot's own: other slots ran tasks meanwhile, "
            "outside the proxy).",
            ["outcome"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.prefill_saved_seconds = Counter(
            "prefill_saved_seconds",
            "Estimated prefill seconds llama-server did not spend because of the sidecar, by what put the KV "
            "back (restore: a restore round after a restart; swap: a library snapshot swapped in for its "
            "request): tokens the slot's next task reused after an effective restore (at most the tokens "
            "restored), priced at the server's own prefill rate (llamacpp:prompt_tokens_total over "
            "llamacpp:prompt_seconds_total, the last one measured over 512 tokens or more).",
            ["by"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.prefill_saved_tokens = Counter(
            "prefill_saved_tokens",
            "Prompt tokens behind llama_sidecar_prefill_saved_seconds_total: reused by a slot's next task after "
            "an effective restore or swap (at most the tokens restored), once priced.",
            ["by"],
            namespace=NAMESPACE,
            registry=registry,
        )
        for saved_by in outcomes.SavedBy:
            self.prefill_saved_seconds.labels(saved_by.value)
            self.prefill_saved_tokens.labels(saved_by.value)

    def _block_store_families(self, registry: CollectorRegistry) -> None:
        """The block store (``--store-dir``): what it wrote, what it did not need to, what it holds."""
        self.store_written = Counter(
            "store_written_bytes",
            "Bytes the block store (--store-dir) wrote, by kind: blocks (only those it did not hold), manifests "
            "(recipes and snapshot manifests).",
            ["kind"],
            namespace=NAMESPACE,
            registry=registry,
        )
        for kind in outcomes.StoreWrite:
            self.store_written.labels(kind.value)
        self.store_deduplicated = Counter(
            "store_deduplicated_bytes",
            "Bytes of saved slot files the block store did not write because it held their blocks already.",
            namespace=NAMESPACE,
            registry=registry,
        )
        self.store_unique = Gauge(
            "store_unique_bytes",
            "Bytes of the blocks the block store holds, each stored once (0 without --store-dir).",
            namespace=NAMESPACE,
            registry=registry,
        )
        self.store_represented = Gauge(
            "store_represented_bytes",
            "Bytes the snapshots of the block store represent: what whole files would take (0 without --store-dir).",
            namespace=NAMESPACE,
            registry=registry,
        )
        self.store_staged = Gauge(
            "store_staged_bytes",
            "Bytes staged in the slot dir (RAM on a tmpfs) now, measured: saves llama-server wrote that are not "
            "ingested yet, and snapshots rebuilt for its restores, ahead of a restart's restore round too "
            "(0 without --store-dir).",
            namespace=NAMESPACE,
            registry=registry,
        )
        self.staged_on_disk = Counter(
            "store_staged_on_disk",
            "Saves and restores staged on the store's disk (--store-dir) instead of the slot dir, by reason: "
            "no_room (the slot dir's free space was below the slot file's estimated size).",
            ["reason"],
            namespace=NAMESPACE,
            registry=registry,
        )
        for fallback in outcomes.StagingFallback:
            self.staged_on_disk.labels(fallback.value)
        self.restore_ahead = Counter(
            "restore_ahead",
            "Snapshots of the block store rebuilt into the slot dir ahead of a restart's restore round, while "
            "llama-server loaded, by outcome: used (its restore waited for no rebuild), unused (given back: a "
            "newer snapshot won, the slot was not empty, no round came), skipped (not rebuilt ahead for lack of "
            "room in the slot dir's filesystem or RAM; rebuilt by its restore).",
            ["outcome"],
            namespace=NAMESPACE,
            registry=registry,
        )
        for outcome in outcomes.RestoreAhead:
            self.restore_ahead.labels(outcome.value)

    def _slot_dir_families(self, registry: CollectorRegistry) -> None:
        """The slot dir: disk, files, retention, quarantine, I/O errors, commits."""
        self.disk_used = Gauge(
            "disk_used_bytes",
            "Bytes of all files in the slot dir (snapshots, temp, quarantine).",
            namespace=NAMESPACE,
            registry=registry,
        )
        self.disk_free = Gauge(
            "disk_free_bytes",
            "Bytes free for unprivileged users on the slot dir's filesystem.",
            namespace=NAMESPACE,
            registry=registry,
        )
        self.snapshot_files = Gauge(
            "snapshot_files",
            "Committed snapshots (with a manifest) in the slot dir.",
            namespace=NAMESPACE,
            registry=registry,
        )
        self.gc_deleted = Counter(
            "gc_deleted",
            "Snapshots deleted by retention, by reason: keep (over --keep-per-slot of a slot, for "
            "snapshots not indexed by content), superseded (a prefix of --keep-per-slot newer snapshots "
            "of the same conversation), bytes (over --max-bytes, least recently used first), age (unused "
            "for --max-age).",
            ["reason"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.quarantined = Counter(
            "snapshots_quarantined",
            "Snapshot files taken out of use, by reason: checksum (bytes changed), size (truncated "
            "or missing), manifest (unreadable or inconsistent manifest), not_regular (a snapshot's name "
            "is a symbolic link, FIFO or device: never read nor restored), oversized (a manifest larger "
            "than any manifest, refused unread).",
            ["reason"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.slot_dir_errors = Counter(
            "slot_dir_errors",
            "I/O errors in the slot dir that were not retried away, by operation: read (a manifest or "
            "snapshot could not be read; it is not quarantined, nothing proves it bad), write (a rename "
            "or delete failed), scan (the directory could not be listed or measured: removed, moved, "
            "unmounted). /readyz names the current problem.",
            ["operation"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.last_snapshot = Gauge(
            "last_snapshot_timestamp_seconds",
            "Unix time of the newest committed snapshot.",
            namespace=NAMESPACE,
            registry=registry,
        )
        self.unsaved_since = Gauge(
            "slot_unsaved_since_timestamp_seconds",
            "Unix time of the oldest change to the slot's KV that no snapshot holds yet (a crash of "
            "llama-server now loses the turns since); 0 while every change is saved. A save is held at most "
            "--save-hold-seconds after it, so time() minus this stays below that plus --idle-seconds unless "
            "saves fail or the slot never goes idle.",
            ["slot"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.snapshot_write_errors = Counter(
            "snapshot_write_errors",
            "Saves whose commit the disk the snapshots are kept on (--store-dir, else the slot dir) refused, by "
            "reason: no_space (full, or over quota), read_only, denied (permissions). Later saves are skipped "
            '(snapshots_total{result="skipped"}) until the disk takes writes again; committed snapshots stay.',
            ["reason"],
            namespace=NAMESPACE,
            registry=registry,
        )
        for fault in outcomes.StoreFault:
            self.snapshot_write_errors.labels(fault.value)
        self.commits_pending = Gauge(
            "snapshot_commits_pending",
            "Snapshots llama-server has written whose commit (checksum, fdatasync, manifest) waits for a "
            "moment when no slot is processing, at most 60 s; not restorable until committed.",
            namespace=NAMESPACE,
            registry=registry,
        )

    def _proxy_families(self, registry: CollectorRegistry) -> None:
        """The proxy: requests by route and outcome, requests held at the gate."""
        self.proxy_requests = Counter(
            "proxy_requests",
            "Requests through the proxy (--proxy-listen), by route (completion: routes that run a "
            "task in a slot and wait at the restore gate; other) and outcome: ok (llama-server's "
            "answer relayed, whatever its status), error (llama-server unreachable, or gone "
            "mid-answer), held_timeout (held --proxy-hold-seconds, answered 503), refused (slot "
            "action, unknown write route or /predict slot format without the admin token), invalid "
            "(bad path, body too big or too slow), busy (request bodies in flight at "
            "--proxy-max-inflight-body-bytes, answered 503), cancelled (the client went away first).",
            ["route", "outcome"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.proxy_hold = Histogram(
            "proxy_hold_seconds",
            "Seconds a request waited at the restore gate (while llama-server was down, loading "
            "or being restored), for requests that met it closed.",
            buckets=_HOLD,
            namespace=NAMESPACE,
            registry=registry,
        )
        self.proxy_inflight = Gauge(
            "proxy_inflight_requests",
            "Requests the proxy is handling now, those held at the gate included.",
            namespace=NAMESPACE,
            registry=registry,
        )
        self.proxy_body_bytes = Gauge(
            "proxy_body_bytes",
            "Bytes of request bodies the proxy holds now, all clients together (capped by "
            "--proxy-max-inflight-body-bytes).",
            namespace=NAMESPACE,
            registry=registry,
        )
        self.proxy_connections = Gauge(
            "proxy_connections",
            "Client connections open to the proxy now (capped by --proxy-max-connections).",
            namespace=NAMESPACE,
            registry=registry,
        )
        self.proxy_connections_refused = Counter(
            "proxy_connections_refused",
            "Client connections answered 503 and closed at once because --proxy-max-connections were open.",
            namespace=NAMESPACE,
            registry=registry,
        )
        self.proxy_held = Gauge(
            "proxy_held_requests",
            "Requests waiting at the restore gate now.",
            namespace=NAMESPACE,
            registry=registry,
        )

    def _library_families(self, registry: CollectorRegistry) -> None:
        """The conversation library: routing, swaps, its size."""
        self.conversation_requests = Counter(
            "conversation_requests",
            "Completion requests routed by the proxy and answered, by where their prompt's prefix came from, "
            "as the answer's own reuse figure (timings.cache_n, usage cached tokens) shows: slot (already in "
            "a slot), ram (loaded by llama-server from its RAM prompt cache, nothing restored), library (swapped "
            "in from a snapshot), shared (from the shared store), cold (prefilled "
            "from scratch: nothing held it, or the server re-prefilled what was put there). Rejected, cut "
            "and cancelled requests are in conversation_unserved_total instead.",
            ["source"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.conversation_unrouted = Counter(
            "conversation_unrouted",
            "Completion requests forwarded without routing, by reason: tokenize (llama-server could "
            "not tokenize the prompt), swap (the swap into a slot failed), error (any other routing "
            "error), own_slot (the request names its id_slot), body (not JSON, several prompts, or a body "
            "llama-server refuses), media (images or audio), infill (/infill), embedding (embeddings, "
            "reranking), audio (transcriptions). The request itself is forwarded as it came; llama-server "
            "picks its slot.",
            ["reason"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.conversation_unserved = Counter(
            "conversation_unserved",
            "Routed completion requests that were no serve, by reason: rejected (llama-server answered an "
            "error status: a bad request, a prompt over the context), cut (llama-server went away mid-answer), "
            "cancelled (the client went away first).",
            ["reason"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.library_prompt_bytes = Counter(
            "library_prompt_bytes",
            "Bytes of prompt text (rendered chats, completion prompts) the proxy's routing needed token ids for, "
            "by how it got them: asked (sent to llama-server's /tokenize), remembered (ids held from the "
            "conversation's earlier turns: no round trip for those bytes). Remembered over the sum is the share "
            "of tokenizing the token cache saved.",
            ["source"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.library_routes = Counter(
            "library_routes",
            "Completion requests the proxy's routing placed, by how it found their place: turn (the request "
            "continues the conversation a slot ran last, seen from its body alone: no round trip to llama-server), "
            "tokens (by the prompt's token ids: /apply-template and /tokenize, or the token cache). Turn over the "
            "sum is the share of turns routed without asking the server.",
            ["by"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.library_slots_read_retries = Counter(
            "library_slots_read_retries",
            "Reads of llama-server's /slots on a routed request's path that had no answer within 0.5 s and were "
            "sent once more on a new connection, by which read answered: first (the one sent first), second (the "
            "one sent again), neither (none within --request-timeout or errors on both, and the request went "
            'unrouted, counted in conversation_unrouted_total{reason="error"}; or the client went away first). '
            "llama-server answers /slots within a millisecond even while it computes: a count that keeps rising "
            "means its HTTP threads are stalling (see its log); each such read still cost its request 0.5 s.",
            ["answered"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.library_tokens = Counter(
            "library_tokens",
            "Prompt tokens served from the library: of the prefix a swap put into a slot ahead of its request, "
            "those the request's answer shows the server reused.",
            namespace=NAMESPACE,
            registry=registry,
        )
        self.swap_duration = Histogram(
            "swap_duration_seconds",
            "Seconds a swap took before its request was forwarded: the save of the slot's own content "
            "(when it changed since its last snapshot) plus the restore of the library snapshot.",
            buckets=_FAST,
            namespace=NAMESPACE,
            registry=registry,
        )
        self.library_conversations = Gauge(
            "library_conversations",
            "Snapshots in the library indexed by content (each a conversation, or a turn of one kept by "
            "--keep-per-slot).",
            namespace=NAMESPACE,
            registry=registry,
        )
        self.library_bytes = Gauge(
            "library_bytes",
            "Bytes of the snapshots in the library indexed by content.",
            namespace=NAMESPACE,
            registry=registry,
        )
        self.ram_conversations = Gauge(
            "library_ram_conversations",
            "Conversations the library counts on llama-server's RAM prompt cache to hold: they left their slot for "
            "another's task, oldest dropped first past --server-cache-ram-bytes; 0 after a restart.",
            namespace=NAMESPACE,
            registry=registry,
        )
        self.left_unsaved = Histogram(
            "library_left_unsaved_reprefill_seconds",
            "Conversations that left their slot for llama-server's RAM prompt cache without a save first (the "
            "save would have stalled every slot), by the seconds a crash of the server would then cost to "
            "re-prefill what no snapshot holds of each (its tokens past its newest snapshot at the measured "
            "prefill rate; at most --max-unsaved-seconds).",
            namespace=NAMESPACE,
            registry=registry,
            buckets=_HOLD,
        )
        for source in CONVERSATION_SOURCES:
            self.conversation_requests.labels(source)
        for reason in UNROUTED_REASONS:
            self.conversation_unrouted.labels(reason)
        for reason in UNSERVED_REASONS:
            self.conversation_unserved.labels(reason)
        for source in PROMPT_BYTE_SOURCES:
            self.library_prompt_bytes.labels(source)
        for by in ROUTE_METHODS:
            self.library_routes.labels(by)
        for answered in SLOTS_RETRY_ANSWERS:
            self.library_slots_read_retries.labels(answered)

    def _shared_families(self, registry: CollectorRegistry) -> None:
        """The shared store: transfers, errors, uploads waiting."""
        self.shared_bytes = Counter(
            "shared_store_bytes",
            "Bytes of snapshots moved to (up) or from (down) the shared store (--shared-store).",
            ["direction"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.shared_objects = Counter(
            "shared_store_objects",
            "Snapshots uploaded to (up) or downloaded from (down) the shared store; a snapshot "
            "another node had already uploaded is not counted.",
            ["direction"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.shared_block_bytes = Counter(
            "shared_store_block_bytes",
            "Bytes of snapshot files moved to (up) or from (down) the shared store as blocks (with "
            "--store-dir, or a node fetching another's blocks), by outcome: transferred (blocks the other "
            "side lacked, and the recipe) or skipped (blocks the other side held already: not moved).",
            ["direction", "outcome"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.shared_transfer = Histogram(
            "shared_store_transfer_seconds",
            "Seconds one snapshot took to upload (up) or download and verify (down).",
            ["direction"],
            buckets=_TRANSFER,
            namespace=NAMESPACE,
            registry=registry,
        )
        self.shared_errors = Counter(
            "shared_store_errors",
            "Failed operations on the shared store, by operation: put, get, list, delete. Local "
            "snapshots and restores go on; uploads are retried with backoff until the store answers.",
            ["operation"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.shared_refused = Counter(
            "shared_store_refused",
            "Objects of the shared store this node refused, by reason: incompatible (the snapshot's "
            "manifest names other weights, adapters, build or slot count than this server's), corrupt "
            "(the blob does not match its manifest's size or checksum), oversized (a manifest object "
            "larger than any manifest, refused unread), unreadable (a manifest that does not parse). "
            "Never fetched again nor restored by this node; the request is prefilled instead.",
            ["reason"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.shared_pending = Gauge(
            "shared_store_pending_uploads",
            "Committed snapshots waiting to be uploaded to the shared store (grows while it is down).",
            namespace=NAMESPACE,
            registry=registry,
        )

    def _model_families(self, registry: CollectorRegistry) -> None:
        """Router mode: the model_* families (see :meth:`for_model`)."""
        self.model: str | None = None
        """The router-mode model this view counts for (see :meth:`for_model`); None for a plain server."""
        self._slot_counts: dict[str | None, int] = {}
        """Slots of each model (None: a plain server), as :meth:`init_slots` was last told."""
        self.model_up = Gauge(
            "model_up",
            "Router mode (--router): 1 while the router runs the model loaded (or asleep) and answers for it, "
            "0 while it is unloaded or loading. server_up is then the router's own /health.",
            ["model"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.model_snapshots = Counter(
            "model_snapshots",
            "Router mode (--router): snapshots_total by model and result (the model name the router lists).",
            ["model", "result"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.model_restores = Counter(
            "model_restores",
            "Router mode (--router): restores_total by model and result (the model name the router lists).",
            ["model", "result"],
            namespace=NAMESPACE,
            registry=registry,
        )

    def _preinitialise(self) -> None:
        """Every bounded label set at zero, so no series is missing when Prometheus first scrapes."""
        for direction in SHARED_DIRECTIONS:
            self.shared_bytes.labels(direction)
            self.shared_objects.labels(direction)
            self.shared_transfer.labels(direction)
            for moved in outcomes.BlockTransfer:
                self.shared_block_bytes.labels(direction, moved.value)
        for operation in SHARED_OPERATIONS:
            self.shared_errors.labels(operation)
        for reason in SHARED_REFUSALS:
            self.shared_refused.labels(reason)
        for outcome in VERIFY_OUTCOMES:
            self.restore_verifications.labels(outcome)
        for route in outcomes.Route:  # at zero without the proxy too, so dashboards and alerts see series
            for result in outcomes.ProxyOutcome:
                self.proxy_requests.labels(route.value, result.value)
        for reason in GC_REASONS:
            self.gc_deleted.labels(reason)
        for reason in QUARANTINE_REASONS:
            self.quarantined.labels(reason)
        for operation in SLOT_DIR_OPERATIONS:
            self.slot_dir_errors.labels(operation)

    def for_model(self, model: str) -> Metrics:
        """The metrics one model's engine writes in router mode (see :class:`ModelMetrics`)."""
        return ModelMetrics(self, model)

    def forget_model(self, model: str) -> None:
        """Drop a model's ``model_*`` series once the router no longer lists it."""
        self.model_up.remove(model)
        for result in SNAPSHOT_RESULTS:
            self.model_snapshots.remove(model, result)
        for result in RESTORE_RESULTS:
            self.model_restores.remove(model, result)

    def memory_is(self, kind: events.Memory) -> None:
        """The served model's memory kind (``model_memory_info``)."""
        for each in events.Memory:
            self.model_memory.labels(each.value).set(1 if each is kind else 0)

    def count_model(self, counter: Counter, result: str) -> None:
        """Count one outcome in a ``model_*`` counter, in a :meth:`for_model` view only."""
        if self.model is not None:
            counter.labels(self.model, result).inc()

    def init_slots(self, slot_ids: range) -> None:
        """Create every (slot, result) series at zero once the slot count is known; remove those of slots gone.

        A server restarted with fewer slots leaves the series of the others behind, each one a line of
        every scrape: they are removed. In router mode the per-slot series are shared by the models, so
        the slots of the model with the most are kept.
        """
        self._slot_counts[self.model] = len(slot_ids)
        kept = max(self._slot_counts.values())
        for slot in range(kept):
            label = str(slot)
            for result in SNAPSHOT_RESULTS:
                self.snapshots.labels(label, result)
            for result in RESTORE_RESULTS:
                self.restores.labels(label, result)
            self.restored_tokens.labels(label)
            self.unsaved_since.labels(label)
        for family, names in (
            (self.snapshots, ("slot", "result")),
            (self.restores, ("slot", "result")),
            (self.restored_tokens, ("slot",)),
            (self.unsaved_since, ("slot",)),
        ):
            gone = {
                tuple(sample.labels[name] for name in names)
                for collected in family.collect()
                for sample in collected.samples
                if not (sample.labels["slot"].isdigit() and int(sample.labels["slot"]) < kept)
            }
            for values in gone:
                family.remove(*values)


class ModelMetrics(Metrics):
    """One router-mode model's view of the families: shared series, plus its ``model_*`` ones.

    Made by :meth:`Metrics.for_model` over the process's one :class:`Metrics`;
    nothing is registered again. The unlabelled and per-slot series are the
    shared ones (they sum over the models); ``server_up`` becomes
    ``model_up{model}`` (the router's /health is not the model's), and
    :meth:`count_model` counts in the model's series.
    """

    def __init__(self, shared: Metrics, model: str) -> None:  # the families are the shared ones: not built again
        self._shared = shared
        self.model = model
        self.server_up = shared.model_up.labels(model)
        for result in SNAPSHOT_RESULTS:
            shared.model_snapshots.labels(model, result)
        for result in RESTORE_RESULTS:
            shared.model_restores.labels(model, result)

    def __getattr__(self, name: str) -> object:
        """Every family this view does not replace is the shared object's (looked up at each use)."""
        if name == "_shared":
            raise AttributeError(name)
        return getattr(self._shared, name)
