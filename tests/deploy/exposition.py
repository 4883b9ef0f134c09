"""Synthetic /metrics pages of llama-kv-sidecar and llama-server, served over HTTP.

Only for checking PromQL: every metric of the sidecar's metrics contract is
present with every label value, built with prometheus_client in a fresh
registry exactly as the contract names it; llama-server's page copies the
format of its `--metrics` endpoint (names with a `llamacpp:` prefix, counters
already ending in `_total`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

SLOTS = ("0", "1", "2", "3")
SNAPSHOT_RESULTS = ("ok", "failed", "skipped")
RESTORE_RESULTS = ("ok", "failed", "incompatible", "no_snapshot", "slot_busy", "raced", "ineffective", "unverified")
VERIFICATION_OUTCOMES = ("effective", "ineffective", "unverified")
GC_REASONS = ("keep", "superseded", "bytes", "age", "space")
CONVERSATION_SOURCES = ("slot", "ram", "library", "shared", "cold")
UNROUTED_REASONS = ("tokenize", "swap", "error")
SLOTS_RETRY_ANSWERS = ("first", "second", "neither")
QUARANTINE_REASONS = ("checksum", "size", "manifest")
PROXY_ROUTES = ("completion", "other")
PROXY_OUTCOMES = ("ok", "error", "held_timeout", "refused", "invalid", "busy", "cancelled")
SLOT_DIR_OPERATIONS = ("read", "write", "scan")
SHARED_DIRECTIONS = ("up", "down")
SHARED_OPERATIONS = ("put", "get", "list", "delete")
SERVER_EXITS = ("stopped", "exited", "failed", "killed", "not_started")
STORE_WRITES = ("blocks", "manifests")
STAGING_FALLBACKS = ("no_room",)
STORE_FAULTS = ("no_space", "read_only", "denied")
RESTORE_AHEAD = ("used", "unused", "skipped")
SAVE_HOLDS = ("hold", "cheap_tail")
MODELS = ("alpha", "beta")
"""Router mode (--router): the models the router lists."""


def sidecar_registry() -> CollectorRegistry:
    """A registry holding the sidecar's metrics contract, with plausible values."""
    registry = CollectorRegistry()
    ns = "llama_sidecar"
    Gauge("server_up", "1 while /health is ok", namespace=ns, registry=registry).set(1)
    Gauge("server_readable", "0 while llama-server refuses the sidecar", namespace=ns, registry=registry).set(1)
    Counter("server_restarts", "Restarts detected", namespace=ns, registry=registry).inc(2)

    snapshots = Counter("snapshots", "Snapshot attempts", ["slot", "result"], namespace=ns, registry=registry)
    restores = Counter("restores", "Restore attempts", ["slot", "result"], namespace=ns, registry=registry)
    restored_tokens = Counter("restored_tokens", "Tokens put back", ["slot"], namespace=ns, registry=registry)
    for slot in SLOTS:
        for n, result in enumerate(SNAPSHOT_RESULTS):
            snapshots.labels(slot=slot, result=result).inc(10 - 4 * n)
        for n, result in enumerate(RESTORE_RESULTS):
            restores.labels(slot=slot, result=result).inc(len(RESTORE_RESULTS) - n)
        restored_tokens.labels(slot=slot).inc(4000)

    for name in ("snapshot_duration_seconds", "restore_duration_seconds", "restart_to_restore_seconds"):
        histogram = Histogram(name, name, namespace=ns, registry=registry)
        for seconds in (0.008, 0.011, 0.096, 0.4):
            histogram.observe(seconds)

    verifications = Counter(
        "restore_verifications",
        "First prompt after a restore",
        ["outcome"],
        namespace=ns,
        registry=registry,
    )
    for n, outcome in enumerate(VERIFICATION_OUTCOMES):
        verifications.labels(outcome=outcome).inc(6 - 2 * n)

    saved_seconds = Counter("prefill_saved_seconds", "Prefill seconds saved", ["by"], namespace=ns, registry=registry)
    saved_tokens = Counter("prefill_saved_tokens", "Prefill tokens saved", ["by"], namespace=ns, registry=registry)
    for n, by in enumerate(("restore", "swap")):
        saved_seconds.labels(by=by).inc(16.2 - 10 * n)
        saved_tokens.labels(by=by).inc(8000 - 5000 * n)

    Gauge("disk_used_bytes", "Bytes of snapshots", namespace=ns, registry=registry).set(180_000_000)
    Gauge("disk_free_bytes", "Free bytes", namespace=ns, registry=registry).set(52_000_000_000)
    Gauge("snapshot_files", "Snapshots present", namespace=ns, registry=registry).set(8)
    gc_deleted = Counter("gc_deleted", "Retention deletions", ["reason"], namespace=ns, registry=registry)
    for reason in GC_REASONS:
        gc_deleted.labels(reason=reason).inc(3)
    quarantined = Counter(
        "snapshots_quarantined",
        "Files quarantined",
        ["reason"],
        namespace=ns,
        registry=registry,
    )
    for reason in QUARANTINE_REASONS:
        quarantined.labels(reason=reason).inc(0)
    slot_dir_errors = Counter("slot_dir_errors", "Slot dir I/O errors", ["operation"], namespace=ns, registry=registry)
    for operation in SLOT_DIR_OPERATIONS:
        slot_dir_errors.labels(operation=operation).inc(0)
    Info("build", "Version of the sidecar", namespace=ns, registry=registry).info({"version": "0.0.0"})
    Gauge(
        "last_snapshot_timestamp_seconds",
        "Newest good snapshot",
        namespace=ns,
        registry=registry,
    ).set(time.time() - 60)
    Gauge("snapshot_commits_pending", "Commits waiting for no slot to process", namespace=ns, registry=registry).set(1)
    unsaved = Gauge(
        "slot_unsaved_since_timestamp_seconds", "Oldest unsaved change", ["slot"], namespace=ns, registry=registry
    )
    unsaved.labels(slot="0").set(time.time() - 20)
    unsaved.labels(slot="1").set(0)
    reprefill = Gauge(
        "slot_unsaved_reprefill_seconds", "Re-prefill of the unsaved tail", ["slot"], namespace=ns, registry=registry
    )
    reprefill.labels(slot="0").set(0.04)
    reprefill.labels(slot="1").set(0)
    stall = Gauge("slot_save_expected_stall_seconds", "Expected save stall", ["slot"], namespace=ns, registry=registry)
    stall.labels(slot="0").set(1.4)
    stall.labels(slot="1").set(0.7)
    held = Counter("snapshots_held", "Saves held", ["reason"], namespace=ns, registry=registry)
    for n, reason in enumerate(SAVE_HOLDS):
        held.labels(reason=reason).inc(5 // (n + 1))
    proxy_requests = Counter(
        "proxy_requests", "Requests through the proxy", ["route", "outcome"], namespace=ns, registry=registry
    )
    for route in PROXY_ROUTES:
        for n, outcome in enumerate(PROXY_OUTCOMES):
            proxy_requests.labels(route=route, outcome=outcome).inc(100 // (n + 1))
    hold = Histogram("proxy_hold_seconds", "Time held at the gate", namespace=ns, registry=registry)
    for seconds in (0.3, 1.2, 4.0, 121.0):
        hold.observe(seconds)
    Gauge("proxy_inflight_requests", "Requests in flight", namespace=ns, registry=registry).set(3)
    Gauge("proxy_held_requests", "Requests held", namespace=ns, registry=registry).set(1)
    Gauge("proxy_body_bytes", "Request body bytes held", namespace=ns, registry=registry).set(48_000)
    Gauge("proxy_connections", "Client connections open", namespace=ns, registry=registry).set(12)
    Counter("proxy_connections_refused", "Connections refused at the cap", namespace=ns, registry=registry).inc(2)
    sources = Counter("conversation_requests", "Where a prefix came from", ["source"], namespace=ns, registry=registry)
    for n, source in enumerate(CONVERSATION_SOURCES):
        sources.labels(source=source).inc(40 // (n + 1))
    unrouted = Counter("conversation_unrouted", "Requests not routed", ["reason"], namespace=ns, registry=registry)
    for reason in UNROUTED_REASONS:
        unrouted.labels(reason=reason).inc(1)
    unserved = Counter("conversation_unserved", "Routed, not served", ["reason"], namespace=ns, registry=registry)
    for reason in ("rejected", "cut", "cancelled"):
        unserved.labels(reason=reason).inc(1)
    Counter("library_tokens", "Tokens served from the library", namespace=ns, registry=registry).inc(52000)
    prompt_bytes = Counter("library_prompt_bytes", "Prompt bytes", ["source"], namespace=ns, registry=registry)
    prompt_bytes.labels(source="asked").inc(40_000)
    prompt_bytes.labels(source="remembered").inc(900_000)
    routes = Counter("library_routes", "Routed requests", ["by"], namespace=ns, registry=registry)
    routes.labels(by="turn").inc(940)
    routes.labels(by="tokens").inc(60)
    retries = Counter("library_slots_read_retries", "Reads sent again", ["answered"], namespace=ns, registry=registry)
    for n, answered in enumerate(SLOTS_RETRY_ANSWERS):
        retries.labels(answered=answered).inc(3 - n)
    memory = Gauge("model_memory_info", "The model's memory kind", ["memory"], namespace=ns, registry=registry)
    for kind in ("attention", "swa", "swa_full", "recurrent", "hybrid", "unknown"):
        memory.labels(memory=kind).set(1 if kind == "attention" else 0)
    swap = Histogram("swap_duration_seconds", "Swap time", namespace=ns, registry=registry)
    for seconds in (0.12, 0.3, 0.45, 1.1):
        swap.observe(seconds)
    Gauge("library_conversations", "Conversations in the library", namespace=ns, registry=registry).set(14)
    Gauge("library_bytes", "Bytes of the library", namespace=ns, registry=registry).set(400_000_000)
    Gauge("library_ram_conversations", "Held in the server's RAM cache", namespace=ns, registry=registry).set(3)
    exits = Counter("server_exits", "How launched servers ended", ["cause"], namespace=ns, registry=registry)
    for n, cause in enumerate(SERVER_EXITS):
        exits.labels(cause=cause).inc(n % 2)
    Gauge("server_crash_loop", "The launcher gave up", namespace=ns, registry=registry).set(0)
    written = Counter("store_written_bytes", "Block store writes", ["kind"], namespace=ns, registry=registry)
    for n, kind in enumerate(STORE_WRITES):
        written.labels(kind=kind).inc(900_000_000 // (n * 1000 + 1))
    Counter("store_deduplicated_bytes", "Not written", namespace=ns, registry=registry).inc(1_500_000_000)
    Gauge("store_unique_bytes", "Unique bytes", namespace=ns, registry=registry).set(800_000_000)
    Gauge("store_represented_bytes", "Represented bytes", namespace=ns, registry=registry).set(2_400_000_000)
    Gauge("store_staged_bytes", "Staged bytes", namespace=ns, registry=registry).set(0)
    on_disk = Counter("store_staged_on_disk", "Staged on disk", ["reason"], namespace=ns, registry=registry)
    for reason in STAGING_FALLBACKS:
        on_disk.labels(reason=reason).inc(2)
    write_errors = Counter("snapshot_write_errors", "Saves refused", ["reason"], namespace=ns, registry=registry)
    for n, reason in enumerate(STORE_FAULTS):
        write_errors.labels(reason=reason).inc(n)
    ahead = Counter("restore_ahead", "Rebuilt ahead", ["outcome"], namespace=ns, registry=registry)
    for n, outcome in enumerate(RESTORE_AHEAD):
        ahead.labels(outcome=outcome).inc(6 // (n + 1))
    left = Histogram("library_left_unsaved_reprefill_seconds", "Left unsaved", namespace=ns, registry=registry)
    for seconds in (0.4, 1.2, 3.0):
        left.observe(seconds)
    shared_bytes = Counter("shared_store_bytes", "Shared store bytes", ["direction"], namespace=ns, registry=registry)
    shared_objects = Counter(
        "shared_store_objects", "Shared store snapshots", ["direction"], namespace=ns, registry=registry
    )
    transfer = Histogram(
        "shared_store_transfer_seconds", "One transfer", ["direction"], namespace=ns, registry=registry
    )
    block_bytes = Counter(
        "shared_store_block_bytes", "Block bytes", ["direction", "outcome"], namespace=ns, registry=registry
    )
    for n, direction in enumerate(SHARED_DIRECTIONS):
        block_bytes.labels(direction=direction, outcome="transferred").inc(9_000_000 * (3 - n))
        block_bytes.labels(direction=direction, outcome="skipped").inc(36_000_000 * (3 - n))
        shared_bytes.labels(direction=direction).inc(45_000_000 * (3 - n))
        shared_objects.labels(direction=direction).inc(3 - n)
        for seconds in (0.4, 0.9, 2.5):
            transfer.labels(direction=direction).observe(seconds)
    shared_errors = Counter(
        "shared_store_errors", "Shared store errors", ["operation"], namespace=ns, registry=registry
    )
    for operation in SHARED_OPERATIONS:
        shared_errors.labels(operation=operation).inc(1)
    Gauge("shared_store_pending_uploads", "Uploads waiting", namespace=ns, registry=registry).set(2)
    refused = Counter("shared_store_refused", "Shared objects refused", ["reason"], namespace=ns, registry=registry)
    for reason in ("incompatible", "corrupt", "oversized"):
        refused.labels(reason=reason).inc(1)
    model_up = Gauge("model_up", "Router mode: model loaded", ["model"], namespace=ns, registry=registry)
    by_model = ["model", "result"]
    model_snapshots = Counter("model_snapshots", "Snapshots by model", by_model, namespace=ns, registry=registry)
    model_restores = Counter("model_restores", "Restores by model", by_model, namespace=ns, registry=registry)
    for n, model in enumerate(MODELS):
        model_up.labels(model=model).set(1 - n)
        for result in SNAPSHOT_RESULTS:
            model_snapshots.labels(model=model, result=result).inc(3)
        for result in RESTORE_RESULTS:
            model_restores.labels(model=model, result=result).inc(2)
    return registry


LLAMA_SERVER_METRICS = "".join(
    f"# HELP llamacpp:{name} {help_text}\n# TYPE llamacpp:{name} {kind}\nllamacpp:{name} {value}\n"
    for name, kind, help_text, value in (
        (
            "prompt_tokens_total",
            "counter",
            "Number of prompt tokens processed, excluding cached tokens",
            12001,
        ),
        ("prompt_tokens_cached_total", "counter", "Number of prompt tokens reused from the cache", 48000),
        ("prompt_seconds_total", "counter", "Total time spent processing prompts", 41.2),
        ("tokens_predicted_total", "counter", "Number of generation tokens processed", 900),
        ("tokens_predicted_seconds_total", "counter", "Total time spent generating tokens", 12.5),
        ("n_decode_total", "counter", "Total number of llama_decode() calls", 950),
        ("n_tokens_max", "counter", "Largest observed sequence length (prompt + generation)", 12100),
        ("prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s", 380.5),
        ("predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s", 72.0),
        ("requests_processing", "gauge", "Number of requests processing", 1),
        ("requests_deferred", "gauge", "Number of requests deferred", 0),
    )
)


@contextlib.contextmanager
def serve(body: bytes, content_type: str) -> Iterator[str]:
    """Serve `body` at GET /metrics on 127.0.0.1; yield "host:port"."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/metrics":
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            """Keep scrapes out of the test output."""

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, name="metrics-server", daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        yield f"{host!s}:{port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def sidecar_page() -> tuple[bytes, str]:
    """The sidecar's /metrics body and content type."""
    return generate_latest(sidecar_registry()), CONTENT_TYPE_LATEST


def llama_server_page() -> tuple[bytes, str]:
    """llama-server's /metrics body and content type (as llama-server sends it)."""
    return LLAMA_SERVER_METRICS.encode(), "text/plain; version=0.0.4"
