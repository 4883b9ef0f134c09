"""The closed vocabularies of what a save or a restore came to.

Each word is a metric label value (``snapshots_total{result}``,
``restores_total{result}``, ``restore_verifications_total{outcome}``), so
:mod:`sidecar.core.metrics` builds its pre-initialised label sets from these
enums, and callers match on members, never on message text.
"""

from __future__ import annotations

import enum


class SaveResult(enum.StrEnum):
    """``snapshots_total{result}``."""

    OK = "ok"
    FAILED = "failed"
    SKIPPED = "skipped"


class SaveCause(enum.StrEnum):
    """Why a save did not end ``ok``: what the engine does next depends on it."""

    BELOW_MIN_TOKENS = "below_min_tokens"
    """Skipped: the slot holds fewer tokens than ``--min-tokens``; settled until it changes."""
    EMPTY = "empty"
    """Skipped: the server saved 0 tokens; settled until it changes."""
    WITHIN_WINDOW = "within_window"
    """Skipped: a sliding-window model's slot (no ``--swa-full``) holds no more tokens than the window, so a
    restore of it would be re-prefilled anyway (``sidecar.snapshots.windowcell``); settled until it changes."""
    LOW_DISK = "low_disk"
    """Skipped: the filesystem would drop below ``--min-free-bytes``; tried again later."""
    SLOT_BUSY = "slot_busy"
    """Skipped: the slot was processing when read right before the save (nothing is sent to a
    busy slot: the server would hold the call until the request ends); saved once it is idle."""
    NOT_LINKED = "not_linked"
    """Failed: the server's file did not appear in the slot dir (another directory)."""
    NOT_SUPPORTED = "not_supported"
    """Failed: the server answers 501 (no ``--slot-save-path``)."""
    SERVER = "server"
    """Failed: the server refused, timed out or could not be reached."""
    CHECK = "check"
    """Failed: the file the server wrote failed the sidecar's size check, or could not be committed."""
    SLOT_DIR = "slot_dir"
    """Failed: the slot dir could not be read or measured (moved, removed, I/O error); tried again later."""
    STORE_UNWRITABLE = "store_unwritable"
    """Failed (the save that found it), then skipped until the disk takes writes again: the disk the
    snapshots are kept on (``--store-dir``, else the slot dir) is full, read-only or refuses this user."""


SKIP_CAUSES = frozenset(
    {SaveCause.BELOW_MIN_TOKENS, SaveCause.EMPTY, SaveCause.WITHIN_WINDOW, SaveCause.LOW_DISK, SaveCause.SLOT_BUSY}
)


class SaveHold(enum.StrEnum):
    """``snapshots_held_total{reason}``: why a due background save waits while another slot is processing."""

    HOLD = "hold"
    """Within ``--save-hold-seconds`` of the slot's oldest unsaved change: it waits for a moment when no other
    slot is processing."""
    CHEAP_TAIL = "cheap_tail"
    """Past that hold: what a crash would lose of the slot (its tokens past its last snapshot) re-prefills
    faster than the save would stall every slot, and within ``--max-unsaved-seconds``."""


class RestoreOutcome(enum.StrEnum):
    """``restores_total{result}``."""

    OK = "ok"
    FAILED = "failed"
    INCOMPATIBLE = "incompatible"
    NO_SNAPSHOT = "no_snapshot"
    SLOT_BUSY = "slot_busy"
    RACED = "raced"
    """A request ran on the slot while the restore call was in flight: the server deferred the
    restore behind it, and the restore then replaced that request's KV."""
    INEFFECTIVE = "ineffective"
    """Restored into a sliding-window model's server, which cannot say whether its layout fits
    (``--swa-full`` is not in /props), and the slot's next request did not reuse it."""
    UNVERIFIED = "unverified"
    """As ``ineffective``, but nothing decided before the restore was lost (a restart, no readable
    /metrics, other slots' tasks mixed into the server's counter). In /status: a restore still
    waiting for its slot's next request."""


class Verification(enum.StrEnum):
    """``restore_verifications_total{outcome}``."""

    EFFECTIVE = "effective"
    INEFFECTIVE = "ineffective"
    UNVERIFIED = "unverified"
    """No per-slot figure: the slot's next task ran beside other slots' tasks, outside the proxy."""


class SharedRefusal(enum.StrEnum):
    """Why an object of the shared store was refused (``shared_store_refused_total{reason}``)."""

    INCOMPATIBLE = "incompatible"
    """Its manifest does not fit this server (weights, adapters, build, slot count): the key prefix is no proof."""
    CORRUPT = "corrupt"
    """Its blob does not match its manifest's size or checksum (damaged or tampered with)."""
    OVERSIZED = "oversized"
    """A manifest object larger than any manifest can be: refused unread."""
    UNREADABLE = "unreadable"
    """A manifest object that does not parse."""


class Source(enum.StrEnum):
    """Where a request's prefix comes from (``conversation_requests_total{source}``)."""

    SLOT = "slot"
    RAM = "ram"
    """llama-server's own RAM prompt cache, with the request pinned to an idle slot and nothing restored."""
    LIBRARY = "library"
    SHARED = "shared"
    COLD = "cold"


class RouteBy(enum.StrEnum):
    """How the library found where a completion goes (``library_routes_total{by}``)."""

    TURN = "turn"
    """The request continues the conversation a slot ran last (``library.turns``): no round trip to the server."""
    TOKENS = "tokens"
    """By the prompt's token ids (``/apply-template``, ``/tokenize`` or the token cache)."""
    RAM_TURN = "ram_turn"
    """The request continues a conversation that left its slot for llama-server's RAM prompt cache: placed by that
    copy's block hashes, with no round trip to tokenize first."""


class PromptBytes(enum.StrEnum):
    """How the library got the token ids of a prompt text's bytes (``library_prompt_bytes_total{source}``)."""

    ASKED = "asked"
    """Sent to llama-server's ``/tokenize``."""
    REMEMBERED = "remembered"
    """Ids held from an earlier text (the token cache): no bytes sent."""


class SlotsRetry(enum.StrEnum):
    """Which read of ``/slots`` answered once it was sent again (``library_slots_read_retries_total{answered}``)."""

    FIRST = "first"
    """The read sent first, after all: the second was dropped."""
    SECOND = "second"
    """The read sent again, on a new connection: the first was dropped."""
    NEITHER = "neither"
    """No answer taken: none within ``--request-timeout`` or errors on both (the request went unrouted), or the
    request went away first."""


class Unrouted(enum.StrEnum):
    """Why a request was forwarded without routing (``conversation_unrouted_total{reason}``)."""

    TOKENIZE = "tokenize"
    """llama-server could not give the prompt's token ids."""
    SWAP = "swap"
    """Saving the slot's own content, or restoring the library snapshot into it, failed."""
    ERROR = "error"
    """Anything else: the sidecar had not read the slots yet, an unexpected failure."""
    OWN_SLOT = "own_slot"
    """The request picks its own slot (``id_slot``)."""
    BODY = "body"
    """Not one prompt the library can read: not JSON, several prompts, or a body llama-server refuses (400)."""
    MEDIA = "media"
    """Images or audio: the library indexes token ids, and a prompt with media has pieces that are not ids."""
    INFILL = "infill"
    """``/infill``: llama-server builds the prompt from fill-in-the-middle pieces the proxy does not render."""
    EMBEDDING = "embedding"
    """Embeddings and reranking: no conversation to continue."""
    AUDIO = "audio"
    """Audio transcriptions: the prompt is an uploaded file."""


class Unserved(enum.StrEnum):
    """Routed completions that were no serve (``conversation_unserved_total{reason}``): not counted by source."""

    REJECTED = "rejected"
    """llama-server answered with an error status (400: a bad request, a prompt over the context; 5xx)."""
    CUT = "cut"
    """llama-server went away after the answer had begun: the client got part of it."""
    CANCELLED = "cancelled"
    """The client went away before the answer ended."""


class Route(enum.StrEnum):
    """The route class, a metric label."""

    COMPLETION = "completion"
    OTHER = "other"


class ProxyOutcome(enum.StrEnum):
    """How a request through the proxy ended, a metric label."""

    OK = "ok"
    """llama-server's answer was relayed to the end, whatever its status."""
    ERROR = "error"
    """llama-server could not be reached or went away mid-answer (502, or a stream cut)."""
    HELD_TIMEOUT = "held_timeout"
    """Held at the restore gate for --proxy-hold-seconds without the gate opening (503)."""
    REFUSED = "refused"
    """A slot action, a write to a path llama-server has no route for, or a /predict body that reaches a
    slot action, without the sidecar's admin token (403)."""
    INVALID = "invalid"
    """A path the proxy does not forward, a body over --proxy-max-body-bytes, or one not received within
    --proxy-body-timeout (400, 413, 408)."""
    BUSY = "busy"
    """Refused before forwarding because bodies in flight reached --proxy-max-inflight-body-bytes (503)."""
    CANCELLED = "cancelled"
    """The client went away first; the upstream request was cancelled with it."""


class StoreFault(enum.StrEnum):
    """``snapshot_write_errors_total{reason}``: why the disk the snapshots are kept on refused a save's write."""

    NO_SPACE = "no_space"
    """ENOSPC or EDQUOT: the filesystem (or the user's quota) is full."""
    READ_ONLY = "read_only"
    """EROFS: the filesystem is mounted read-only (often remounted so by the kernel after an I/O error)."""
    DENIED = "denied"
    """EACCES or EPERM: this user may not write there."""


class StagingFallback(enum.StrEnum):
    """``store_staged_on_disk_total{reason}``: why a file was staged on the store's disk, not in the slot dir."""

    NO_ROOM = "no_room"
    """The slot dir's free space (a tmpfs: RAM) was below the file's estimated size and some headroom."""


class StoreWrite(enum.StrEnum):
    """``store_written_bytes_total{kind}``: what the block store (``--store-dir``) wrote."""

    BLOCKS = "blocks"
    MANIFESTS = "manifests"
    """Recipes and snapshot manifests."""


class RestoreAhead(enum.StrEnum):
    """``restore_ahead_total{outcome}``: what became of a snapshot rebuilt ahead, while the server loaded."""

    USED = "used"
    """A restore took it: its restore call waited for no rebuild."""
    UNUSED = "unused"
    """Given back unused: the slot got a newer snapshot or one a request held at the gate wanted, or was not
    empty, or no restore round came."""
    SKIPPED = "skipped"
    """Not rebuilt ahead: the slot dir's filesystem or the RAM lacked room (the restore rebuilds it then)."""


class SavedBy(enum.StrEnum):
    """What put back the KV a request reused (``prefill_saved_seconds_total{by}``)."""

    RESTORE = "restore"
    """A restore round after a restart or a wake-up."""
    SWAP = "swap"
    """A library (or shared-store) snapshot swapped into a slot for the request that needed it."""


class SnapshotProblem(enum.StrEnum):
    """``SnapshotError.reason`` values raised by the store (the bad-content ones: ``snapshots_quarantined_total``)."""

    CHECKSUM = "checksum"
    SIZE = "size"
    MANIFEST = "manifest"
    IO = "io"
    """An I/O error: nothing is known about the content."""
    MISSING = "missing"
    """The server's file is not in the slot dir (another directory, or gone)."""
    EMPTY = "empty"
    NOT_REGULAR = "not_regular"
    """A snapshot's name is a symbolic link, a FIFO, a device, ...: never read, never restored."""
    OVERSIZED = "oversized"
    """A manifest larger than ``manifest.MAX_BYTES``: refused unread."""


class BlockProblem(enum.StrEnum):
    """``BlockStoreError.reason``: why the block store could not rebuild a file."""

    MISSING = "missing"
    """A block the recipe names is not in the store, or the recipe itself is not."""
    TRUNCATED = "truncated"
    """A block holds another number of bytes than its recipe says."""
    CORRUPT = "corrupt"
    """A block's bytes no longer hash to its name (the reassembled file failed its checksum)."""
    RECIPE = "recipe"
    """The recipe does not parse, or is larger than any recipe."""
    NOT_REGULAR = "not_regular"
    """A block or recipe name is a symbolic link, a FIFO, a device, ...: never read."""
    IO = "io"
    """An I/O error: nothing is known about the content."""


BAD_CONTENT = frozenset(
    {
        SnapshotProblem.CHECKSUM,
        SnapshotProblem.SIZE,
        SnapshotProblem.MANIFEST,
        SnapshotProblem.NOT_REGULAR,
        SnapshotProblem.OVERSIZED,
    }
)
"""The only reasons that quarantine a snapshot."""


class SlotDirOperation(enum.StrEnum):
    """What the store was doing when the slot dir failed (``slot_dir_errors_total{operation}``)."""

    READ = "read"
    WRITE = "write"
    SCAN = "scan"


class GcReason(enum.StrEnum):
    """Why retention deleted a snapshot (``gc_deleted_total{reason}``)."""

    KEEP = "keep"
    """Beyond the newest --keep-per-slot of a slot (snapshots not indexed by content)."""
    SUPERSEDED = "superseded"
    """Its tokens are a prefix of --keep-per-slot newer snapshots of the same conversation."""
    BYTES = "bytes"
    """The least recently used while the library is over --max-bytes."""
    AGE = "age"
    """Not used for longer than --max-age."""
    SPACE = "space"
    """The least recently used, deleted so that a save fits above --min-free-bytes."""


class SharedOperation(enum.StrEnum):
    """What the shared store was doing when it failed (``shared_store_errors_total{operation}``)."""

    PUT = "put"
    GET = "get"
    LIST = "list"
    DELETE = "delete"


class Direction(enum.StrEnum):
    """Which way a snapshot crossed to or from the shared store (``shared_store_*{direction}``)."""

    UP = "up"
    DOWN = "down"


class BlockTransfer(enum.StrEnum):
    """What became of a snapshot's bytes in a block transfer (``shared_store_block_bytes_total{outcome}``)."""

    TRANSFERRED = "transferred"
    """Blocks the other side lacked (and the recipe): sent up or fetched down."""
    SKIPPED = "skipped"
    """Blocks the other side held already: not moved."""


class ServerExit(enum.StrEnum):
    """How a llama-server the sidecar launched (``run ... -- llama-server``) ended (``server_exits_total{cause}``)."""

    STOPPED = "stopped"
    """The sidecar stopped it, on its own shutdown."""
    EXITED = "exited"
    """It exited on its own with status 0."""
    FAILED = "failed"
    """It exited with a non-zero status (a bad argument, a model that does not load, a port taken, ...)."""
    KILLED = "killed"
    """A signal ended it (the kernel's OOM killer, ``kill -9``, a crash: SIGSEGV, SIGABRT)."""
    NOT_STARTED = "not_started"
    """It could not be started at all (the program is missing or not executable)."""


class ChildState(enum.StrEnum):
    """Where the launcher stands with its llama-server (``/status``'s ``launcher.state``)."""

    STARTING = "starting"
    RUNNING = "running"
    RESTARTING = "restarting"
    """It ended; the launcher waits its backoff before starting it again."""
    GAVE_UP = "gave_up"
    """It ended before it ever served, by its own doing or in a crash loop: the sidecar ends, naming the cause."""
    STOPPING = "stopping"
    STOPPED = "stopped"


class AgentState(enum.StrEnum):
    """What the sidecar tells a load balancer of its node on the agent-check port (``--agent-check-listen``)."""

    UP = "up"
    """llama-server serves and its slots are ready: take requests, at the weight given."""
    DRAIN = "drain"
    """llama-server answers but this node should take no new conversation: a restore round runs, or the slot
    dir is too full to save what it would serve."""
    DOWN = "down"
    """llama-server is down, loading or refuses the sidecar: send its conversations elsewhere."""
