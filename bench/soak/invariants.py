"""What each turn proves, from outside the product: pure functions over what the clients saw.

* **Wrong KV.** A Chat Completions turn asks for the top log-probabilities of its first token; the same
  request is sent to a cold reference llama-server (same binary, model, template; ``cache_prompt`` off).
  A slot that holds another conversation's KV, or bytes that are not the KV of its tokens, gives the first
  token another distribution; the same KV computed in other batches moves its probabilities by hundredths
  (log-probabilities of unlikely tokens by up to a nat: a token at 2.6% against 0.9% in one soak, the top
  token's probability moving 0.02). :func:`kv_distance` is the total variation distance between the two
  top lists, the share of probability that moved. Every turn's reuse must
  also stay within what the conversation itself ever sent (:func:`reuse_beyond_history`).
* **No conversation lost.** After a fault, a conversation's next turn must reuse at least
  :data:`WARM_SHARE` of its previous prompt; what a ``kill -9`` may cost (turns that ended within the
  allowance before it: the idle wait and the save hold) is counted apart, as is what a full store disk
  or the burst past the byte budget explains (:func:`classify`).
* **No client-visible error** except on requests that overlapped an outage of the sidecar itself
  (:func:`error_allowed`).
* **Bounded resources** (:func:`breaches`).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping, Sequence

from bench.soak import schedule

WARM_SHARE = 0.99
WRONG_KV = 0.2
"""A total variation distance this large between the first token's distributions, the product's against the
cold reference's, is a wrong KV (noise: hundredths; another conversation's KV: most of the probability)."""
REUSE_SLACK = 32
"""Tokens a turn may reuse past its conversation's previous prompt: the previous answer, re-rendered."""
ANSWER_SLACK = 1.0
"""Seconds a process fault may come before the previous turn's end as its client saw it and still have cost that
turn: the client reads the answer's end after llama-server finished the turn, and the turn's save (its rewind
first) runs after that; a ``kill -9`` in between leaves the turn unsaved."""


class Verdict(enum.StrEnum):
    FIRST = "first"
    """The conversation's first turn: nothing to reuse of its own."""
    WARM = "warm"
    COLD_UNSAVED = "cold_unsaved"
    """Reused less than its previous prompt, but all a ``kill -9`` allows: the turns it lost ended within the
    allowance before it."""
    COLD_STORE_FULL = "cold_store_full"
    """The store's disk was full since its previous turn (it left its slot unsaved), or, before a process was
    killed, when its save was due or after it (a full disk makes the sidecar delete its oldest snapshots)."""
    COLD_EVICTED = "cold_evicted"
    """A burst past the store's byte budget came since its previous turn."""
    COLD_RAM = "cold_ram"
    """Reused an earlier turn of its own, with a process killed or stopped since its previous turn, after the
    allowance: a conversation may leave its slot for llama-server's RAM cache with no save, as long as what a
    crash would lose of it re-prefills within ``--max-unsaved-seconds`` (re-prefill seconds the soak does not
    see), and the RAM cache is gone with the process, SIGTERM or not."""
    COLD_WINDOW = "cold_window"
    """Its previous prompt fit in the model's sliding window (no ``--swa-full``): llama-server reuses a cache
    that short only through its own context checkpoints, which no slot file holds, so no save could give it
    back; the library leaves it to the server's cache and at most a window's tokens re-prefill."""
    UNKNOWN = "unknown"
    """The answer did not say what it reused."""
    LOST = "lost"
    """An invariant broke: cold with nothing that explains it."""


@dataclasses.dataclass(frozen=True, slots=True)
class Done:
    """One turn a conversation had answered."""

    ended: float
    prompt: int


@dataclasses.dataclass(frozen=True, slots=True)
class Window:
    """A fault as the invariants see it: when it began and when it was undone (``at`` for point faults)."""

    fault: schedule.Fault
    at: float
    until: float


def classify(
    before: Sequence[Done],
    *,
    started: float,
    cached: int,
    windows: Sequence[Window],
    allowance: float,
    ended: float | None = None,
    window: int = 0,
) -> Verdict:
    """The verdict on a turn sent at ``started`` that reused ``cached`` tokens, after the turns ``before``.

    ``ended``: when its answer ended. A process killed while it was under way counts as one killed before it:
    the proxy sent it again after the restart, and its answer reused what the restore brought back.
    ``window``: the model's sliding window (0: none, or ``--swa-full``)."""
    if not before:
        return Verdict.FIRST
    if cached < 0:
        return Verdict.UNKNOWN
    last = before[-1]
    if cached >= WARM_SHARE * last.prompt:
        return Verdict.WARM
    if last.prompt <= window:
        return Verdict.COLD_WINDOW
    until = started if ended is None else max(started, ended)
    # A fault that began while the turn was under way may have cost it too: its placement (a swap's save) runs
    # after it was sent.
    since = [w for w in windows if last.ended <= w.at < until or (w.at < last.ended < w.until)]
    if any(w.fault is schedule.Fault.BURST for w in since):
        return Verdict.COLD_EVICTED
    if any(w.fault is schedule.Fault.DISK_FULL for w in since):
        return Verdict.COLD_STORE_FULL  # it left its slot while no save could be written
    kills = [w for w in windows if w.fault in schedule.PROCESS and last.ended - ANSWER_SLACK <= w.at < until]
    for kill in kills:
        grace = 1.0 if kill.fault is schedule.Fault.SIGTERM else allowance  # SIGTERM saves every slot first
        due = [done for done in before if done.ended <= kill.at - grace and done.prompt > window]
        if cached >= WARM_SHARE * max((done.prompt for done in due), default=0):
            return Verdict.COLD_UNSAVED
        if due and any(w.fault is schedule.Fault.BURST and due[-1].ended <= w.at <= kill.at for w in windows):
            return Verdict.COLD_EVICTED  # the snapshot the kill should have left was evicted by a burst first
        full = [w for w in windows if w.fault is schedule.Fault.DISK_FULL and w.at <= kill.at]
        if any(w.until >= kill.at - grace - allowance for w in full):
            return Verdict.COLD_STORE_FULL
        if due and any(w.until >= due[-1].ended for w in full):
            # The newest turn it should have saved was due while the disk was full, or the disk filled after its
            # save: the sidecar then deletes its oldest snapshots to keep --min-free-bytes (reason "space").
            return Verdict.COLD_STORE_FULL
    if kills and any(cached >= WARM_SHARE * done.prompt for done in before[:-1]):
        return Verdict.COLD_RAM
    return Verdict.LOST


def reuse_beyond_history(before: Sequence[Done], cached: int, *, again: int = 0) -> bool:
    """The turn reused more tokens than its conversation ever sent: they came from another.

    ``again``: the turn's own prompt when an earlier attempt of it failed (an error on the sidecar's outage, an
    answer cut): that attempt reached llama-server, and the retry may reuse all of it."""
    if not before or cached < 0:
        return False
    return cached > max(again, *(done.prompt for done in before)) + REUSE_SLACK


def kv_distance(product: Mapping[str, float], reference: Mapping[str, float]) -> float:
    """The total variation distance between the first token's distributions, from the top log-probabilities of
    one answer's first token each: half the sum, over the tokens of either list, of how far the probability moved.
    A token missing from one list has there at most that list's last probability (the least the move can be)."""
    if not reference:
        return 0.0
    if not product:
        return math.inf
    floor_product, floor_reference = math.exp(min(product.values())), math.exp(min(reference.values()))
    moved = 0.0
    for token in product.keys() | reference.keys():
        got, want = product.get(token), reference.get(token)
        if got is not None and want is not None:
            moved += abs(math.exp(got) - math.exp(want))
        elif want is not None:
            moved += max(math.exp(want) - floor_product, 0.0)
        elif got is not None:
            moved += max(math.exp(got) - floor_reference, 0.0)
    return moved / 2


def error_allowed(started: float, ended: float, outages: Sequence[tuple[float, float]]) -> bool:
    """A request from ``started`` to ``ended`` overlapped an outage of the sidecar itself (it held, or would
    have taken, that connection)."""
    return any(started <= until and ended >= at for at, until in outages)


def rss_growth(samples: Sequence[tuple[float, int, float]], since: float) -> float | None:
    """The sidecar's RSS at the end over its RSS at ``since``, both of the one process that ran from
    ``since`` to the end; ``samples``: (time, which start of the sidecar, RSS) in time order. None when no
    process lived through it (a start after ``since``), or no sample tells."""
    after = [(at, start, rss) for at, start, rss in samples if at >= since]
    if len(after) < 2 or after[0][1] != after[-1][1]:
        return None
    return after[-1][2] / after[0][2]


@dataclasses.dataclass(frozen=True, slots=True)
class Bounds:
    """The stated bounds of the soak's resources."""

    rss_bytes: int = 768 << 20
    """The sidecar's resident memory (its RAM cache of blocks included)."""
    open_files: int = 512
    threads: int = 64
    staged_bytes: int = 512 << 20
    """``store_staged_bytes``: rebuilt slot files kept in RAM."""
    store_slack: float = 1.10
    """The store may pass its byte budget by this factor between a commit and the collection after it."""
    rss_growth: float = 1.10
    """The sidecar's RSS at the end over its RSS as the steady stretch began (one process)."""
    rss_minutes: float = schedule.JUDGED_STEADY / 60.0
    """The least steady stretch that judges RSS growth: over a shorter one, growth is caches filling."""


def breaches(peaks: Mapping[str, float], bounds: Bounds, budget: int) -> list[str]:
    """The resources whose peak passed its bound, in words."""
    limits = {
        "rss_bytes": bounds.rss_bytes,
        "open_files": bounds.open_files,
        "threads": bounds.threads,
        "staged_bytes": bounds.staged_bytes,
        "store_bytes": budget * bounds.store_slack,
    }
    return [f"{name} peaked at {peaks[name]:.0f}, bound {limit:.0f}" for name, limit in limits.items()
            if name in peaks and peaks[name] > limit]  # fmt: skip
