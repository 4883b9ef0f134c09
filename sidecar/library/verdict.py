"""What a routed request's answer says about its routing: the per-request verdict. Pure code.

Invariants and trade-offs: docs/modules.md, `sidecar/library/verdict.py`.
"""

from __future__ import annotations

import dataclasses

from sidecar.core import outcomes

EFFECTIVE_SHARE = 0.5
"""Share of the placed prefix a request's answer must show reused for its source to count."""
Source = outcomes.Source


@dataclasses.dataclass(frozen=True, slots=True)
class Planned:
    """Where the library placed a request, before it was forwarded."""

    source: outcomes.Source
    slot: int | None
    prefix_tokens: int = 0
    """Tokens of the request's prefix the chosen source holds (whole blocks)."""
    restored: int = 0
    """Tokens a swap put into the slot for it (library, shared); 0 otherwise."""


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    source: outcomes.Source | None
    """Where the prefix came from, as the answer shows; None: no serve (see ``unserved``)."""
    unserved: outcomes.Unserved | None = None
    library_tokens: int = 0
    """Tokens to count as served from the library (``library_tokens_total``)."""
    reused: int | None = None
    """The answer's own reuse figure, to judge the slot's pending restore by; None: the answer did not say."""


def judge(planned: Planned, *, status: int, outcome: outcomes.ProxyOutcome, cached: int | None) -> Verdict:
    """The verdict on a request placed as ``planned`` whose answer ended with ``status``/``outcome``."""
    if outcome is outcomes.ProxyOutcome.CANCELLED:
        return Verdict(None, outcomes.Unserved.CANCELLED)
    if outcome is not outcomes.ProxyOutcome.OK:
        return Verdict(None, outcomes.Unserved.CUT)
    if status >= 400:
        return Verdict(None, outcomes.Unserved.REJECTED)
    source = planned.source
    if source is not Source.COLD and cached is not None and cached < EFFECTIVE_SHARE * planned.prefix_tokens:
        return Verdict(Source.COLD, reused=cached)  # the server re-prefilled what was put there
    served = 0
    if source in (Source.LIBRARY, Source.SHARED):
        served = min(planned.restored, planned.prefix_tokens if cached is None else cached)
    return Verdict(source, library_tokens=served, reused=cached)


def header(planned: Planned | None, unrouted: outcomes.Unrouted | None = None) -> str:
    """``X-Llama-Sidecar-Prefix``: where the request's prefix was placed, and the tokens restored for it."""
    if planned is None:
        return f"source=unrouted; reason={unrouted.value}" if unrouted is not None else ""
    slot = "none" if planned.slot is None else str(planned.slot)
    return f"source={planned.source.value}; slot={slot}; restored_tokens={planned.restored}"
