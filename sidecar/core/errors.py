"""The sidecar's own error tree.

Invariants and trade-offs: docs/modules.md, `sidecar/core/errors.py`.
"""

from __future__ import annotations


class SidecarError(Exception):
    """Base of every error the sidecar raises on purpose."""


class UpstreamError(SidecarError):
    """llama-server did not give a usable answer."""

    def __init__(self, message: str, *, endpoint: str, status: int | None = None) -> None:
        super().__init__(message)
        self.endpoint = endpoint
        self.status = status


class UpstreamUnavailable(UpstreamError):
    """Connection refused or reset, a timeout, or a 5xx answer."""


class UpstreamNotSupported(UpstreamError):
    """501: the server runs without the flag that enables this endpoint."""


class UpstreamRejected(UpstreamError):
    """A 4xx answer: the server understood the request and refused it."""


class UpstreamDenied(UpstreamRejected):
    """401 or 403: the server runs with --api-key and the sidecar sends none of its keys."""


class UpstreamProtocolError(UpstreamError):
    """The answer was not JSON, lacked fields, or had fields of the wrong type."""


class UpstreamIsRouter(UpstreamProtocolError):
    """/props says ``"role": "router"``: a router-mode llama-server, which has no slots of its own."""


class RouterDetected(SidecarError):
    """Raised out of the poller when a server the sidecar was not told about turns out to be a router.

    ``app.run`` catches it, stops the plain-server wiring and starts router mode
    (``--router`` left unset means: follow what the server says).
    """


class SnapshotError(SidecarError):
    """A snapshot file failed a check (size, checksum, manifest) or an I/O step."""

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class BlockStoreError(SnapshotError):
    """The block store refused a file: ``reason`` is an ``outcomes.BlockProblem`` value.

    ``block`` names the block at fault (its sha256, hex) when one is, so a
    log line can say which; ``name`` is the recipe's name.
    """

    def __init__(self, message: str, *, reason: str, name: str, block: str | None = None) -> None:
        super().__init__(message, reason=reason)
        self.name = name
        self.block = block


class SharedStoreError(SidecarError):
    """The shared store failed an operation (``put``, ``get``, ``list`` or ``delete``); local work goes on."""

    def __init__(self, message: str, *, operation: str, missing: bool = False) -> None:
        super().__init__(message)
        self.operation = operation
        self.missing = missing
        """The object does not exist (a 404, or a file that is not there)."""


class SharedObjectRefused(SharedStoreError):
    """The store answered, but what it holds is refused: ``reason`` is an ``outcomes.SharedRefusal`` value.

    Not an outage: the object is damaged or hostile (a blob that does not
    match its manifest, a manifest object too large to be one), so it is
    never read again, whatever the store does next.
    """

    def __init__(self, message: str, *, operation: str, reason: str) -> None:
        super().__init__(message, operation=operation)
        self.reason = reason


class ConfigError(SidecarError):
    """A flag or environment variable cannot be used as given."""


class ServerNotStarted(SidecarError):
    """Launcher mode: llama-server ended before it ever served, by its own doing; the sidecar ends with it."""

    def __init__(self, message: str, *, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        """The status the sidecar exits with: the server's own, or 1 (a signal, or it could not be run)."""
