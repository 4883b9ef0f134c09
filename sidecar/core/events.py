"""What the poller saw, and what changed between two sightings: pure code.

Invariants and trade-offs: docs/modules.md, `sidecar/core/events.py`.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterator
from typing import NamedTuple


class Health(enum.StrEnum):
    OK = "ok"
    LOADING = "loading"
    DOWN = "down"
    UNLOADED = "unloaded"
    """Router mode: the router answers, but runs no server for the model (not loaded yet, or unloaded)."""


class SlotContent(NamedTuple):
    """What a slot holds, as far as one server process tells: the task that last ran on it, and its tokens.

    Two equal contents of one process are the same KV; a restart makes every content new.
    """

    task: int
    """``id_task`` of the slot's last task."""
    tokens: int
    """Tokens in the slot's cache (``n_prompt_tokens``)."""


UNREAD = SlotContent(-1, 0)
"""The content of a slot whose listing did not say it: whoever saves it reads the slot afresh first."""


@dataclasses.dataclass(frozen=True, slots=True)
class SlotView:
    """One entry of /slots."""

    id: int
    n_ctx: int
    processing: bool
    task: int | None
    """``id_task`` of the slot's last task; None if it never ran one in this process."""
    tokens: int
    """Tokens in the slot's cache (``n_prompt_tokens``); 0 when ``task`` is None."""

    @property
    def signature(self) -> SlotContent | None:
        """What identifies the slot's content within one server process; None while it never ran a task."""
        return None if self.task is None else SlotContent(self.task, self.tokens)

    @property
    def virgin(self) -> bool:
        return self.task is None

    @property
    def empty(self) -> bool:
        return self.task is None or self.tokens == 0


@dataclasses.dataclass(frozen=True, slots=True)
class Adapter:
    """One LoRA adapter loaded by the server (``GET /lora-adapters``)."""

    id: int
    path: str
    scale: float


class Memory(enum.StrEnum):
    """What kind of memory the served model keeps (see ``sidecar.observe.memory``)."""

    ATTENTION = "attention"
    """Every layer attends: a restored state can be cut back to any shorter prefix."""
    SWA = "swa"
    """Sliding-window attention (Gemma 3, gpt-oss, Llama 4's chunks): a restored window is reused only by a request
    that extends all of it, so slots are saved at the prompt's boundary and matched by exact prefix."""
    SWA_FULL = "swa_full"
    """Sliding-window attention on a server seen running with ``--swa-full`` (every position kept): handled as
    ``attention``, restores still verified by the next request."""
    RECURRENT = "recurrent"
    """A recurrent state (Mamba, RWKV): it can be extended, not cut back."""
    HYBRID = "hybrid"
    """Recurrent or convolution layers beside attention layers (Qwen3.5, LFM2, ...): extended, not cut back."""
    UNKNOWN = "unknown"
    """The model file's header could not be read: handled as ``attention``."""


class WindowShape(enum.StrEnum):
    """How a model's windowed layers mask (``llama_swa_type``)."""

    STANDARD = "standard"
    """A token sees the window of positions up to itself (Gemma 2/3, gpt-oss, Cohere 2, ...)."""
    CHUNKED = "chunked"
    """A token sees its own chunk of positions (Llama 4)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Identity:
    """What a snapshot must match to be restored into this server."""

    build_info: str
    model_path: str
    total_slots: int
    n_ctx: int
    model_size: int | None = None
    model_params: int | None = None
    weights: str | None = None
    """Checksum of the model file (``xxh3-128:<hex>``); None when the sidecar cannot read the file."""
    adapters: tuple[Adapter, ...] | None = None
    """LoRA adapters with their scales; None when the server does not say."""
    memory: Memory | None = None
    """The model's memory kind, from its file's GGUF header; None before it is read."""


@dataclasses.dataclass(frozen=True, slots=True)
class Counters:
    """The few /metrics numbers the sidecar needs."""

    start_time: float | None
    prompt_tokens: float
    cached_tokens: float
    activity: tuple[float, ...] = ()
    """Counters that move whenever the server works (decodes, tokens, deferred requests)."""
    processing: float = 0.0
    """``llamacpp:requests_processing``: slots busy right now."""
    prompt_seconds: float = 0.0
    """``llamacpp:prompt_seconds_total``: time the server spent prefilling ``prompt_tokens``."""


@dataclasses.dataclass(frozen=True, slots=True)
class Observation:
    at: float
    """Monotonic time of the poll, in seconds."""
    health: Health
    slots: tuple[SlotView, ...] | None = None
    """None when /slots was not read (server down, timeout, ``--no-slots``)."""
    identity: Identity | None = None
    counters: Counters | None = None
    counters_fresh: bool = False
    """Whether ``counters`` were read in this poll (else carried over from an earlier one)."""
    sleeping: bool = False
    problem: str = ""
    """Why the server is down or its slots unread; empty when all is well."""
    denied: tuple[str, ...] = ()
    """The server's refusals (401/403) of /slots, /props or /metrics in this poll: a missing or wrong API key."""
    slots_at: float | None = None
    """Monotonic time of the /slots read ``slots`` come from: an earlier poll's when carried over; None: ``at``."""

    def slot(self, slot_id: int) -> SlotView | None:
        for view in self.slots or ():
            if view.id == slot_id:
                return view
        return None


class Transition(enum.StrEnum):
    CAME_UP = "came_up"
    WENT_DOWN = "went_down"
    RESTARTED = "restarted"
    BECAME_BUSY = "became_busy"
    BECAME_IDLE = "became_idle"
    SLEPT = "slept"
    """``--sleep-idle-seconds`` unloaded the model and every slot's KV."""
    WOKE = "woke"
    """A request woke the server: its slots start empty."""


@dataclasses.dataclass(frozen=True, slots=True)
class Event:
    transition: Transition
    at: float
    slot: int | None = None
    reasons: tuple[str, ...] = ()
    changed: bool = False


def restart_reasons(before: Observation, after: Observation, *, was_down: bool) -> tuple[str, ...]:
    """Why ``after`` looks like a different server process than ``before``.

    ``before`` is the last observation with the server up and its slots read;
    ``was_down`` says whether the server was unreachable or loading in between.
    """
    reasons: list[str] = []
    if before.counters and after.counters and after.counters_fresh:
        b, a = before.counters, after.counters
        if b.start_time is not None and a.start_time is not None:
            if b.start_time == a.start_time:
                return ()  # the same process: a pause or a network blip, not a restart
            reasons.append("process start time changed")
        elif a.prompt_tokens < b.prompt_tokens or a.cached_tokens < b.cached_tokens:
            reasons.append("metrics counters went backwards")
    if before.identity and after.identity:
        fields = [
            f.name
            for f in dataclasses.fields(Identity)
            if None not in (getattr(before.identity, f.name), getattr(after.identity, f.name))
            and getattr(before.identity, f.name) != getattr(after.identity, f.name)
        ]
        if fields:  # a field one side could not read (None) is no evidence
            reasons.append("server identity changed: " + ", ".join(fields))
    if before.slots is not None and after.slots is not None:
        lost = lost_history(before, after)
        if lost is not None:
            reasons.append(f"slot {lost} lost its task history")
        if was_down and all(s.virgin for s in after.slots):
            reasons.append("server was unreachable and came back with every slot empty")
    return tuple(reasons)


def lost_history(before: Observation, after: Observation) -> int | None:
    """The first slot that ran a task in ``before`` and shows none (or an older one) in ``after``.

    Only a new process, or the same process after ``--sleep-idle-seconds`` unloaded
    and reloaded the model, forgets a slot's task.
    """
    for old in before.slots or ():
        new = after.slot(old.id)
        if old.task is None or new is None:
            continue
        if new.task is None or new.task < old.task:
            return old.id
    return None


def detect(
    prev: Observation | None, cur: Observation, *, last_up: Observation | None, was_down: bool | None = None
) -> list[Event]:
    """Name the transitions from ``prev`` to ``cur``.

    ``last_up`` is the newest earlier observation with the server up and its
    slots read; it carries restart evidence across a down period. ``was_down``
    says whether the server was down or loading at any poll since ``last_up``
    (polls with unreadable /slots sit between); by default it is read off ``prev``.
    """
    events: list[Event] = []
    was_up = prev is not None and prev.health is Health.OK
    if cur.health is not Health.OK:
        if was_up:
            events.append(Event(Transition.WENT_DOWN, cur.at))
        return events
    if not was_up:
        events.append(Event(Transition.CAME_UP, cur.at))
    if cur.sleeping:
        if prev is None or not prev.sleeping:
            events.append(Event(Transition.SLEPT, cur.at))
        return events
    if prev is not None and prev.sleeping:
        events.append(Event(Transition.WOKE, cur.at))
        return events
    if cur.slots is None:
        return events
    if last_up is not None:
        reasons = restart_reasons(last_up, cur, was_down=(not was_up) if was_down is None else was_down)
        if reasons:
            events.append(Event(Transition.RESTARTED, cur.at, reasons=reasons))
            return events
        if lost_history(last_up, cur) is not None:
            # Same process (its start time proves it) but the slots forgot their tasks:
            # it slept and woke between two polls.
            events.append(Event(Transition.WOKE, cur.at))
            return events
    events.extend(_slot_changes(last_up, cur))
    return events


def _slot_changes(base: Observation | None, cur: Observation) -> Iterator[Event]:
    """Each slot of ``cur`` that became busy, or idle (or changed while idle), since ``base``."""
    for view in cur.slots or ():
        old = base.slot(view.id) if base is not None else None
        if view.processing and (old is None or not old.processing):
            yield Event(Transition.BECAME_BUSY, cur.at, slot=view.id)
        elif not view.processing and old is not None:
            changed = view.signature != old.signature
            if old.processing or changed:
                yield Event(Transition.BECAME_IDLE, cur.at, slot=view.id, changed=changed)


class ModelStatus(enum.StrEnum):
    """``status.value`` of a model in the router's ``GET /models``."""

    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    SLEEPING = "sleeping"
    DOWNLOADING = "downloading"
    DOWNLOADED = "downloaded"
    UNKNOWN = "unknown"
    """A state this sidecar does not know (a newer llama-server): treated as not loaded."""

    @classmethod
    def parse(cls, value: str) -> ModelStatus:
        try:
            return cls(value)
        except ValueError:
            return cls.UNKNOWN

    @property
    def running(self) -> bool:
        """A child server runs for the model (it may still load, or sleep)."""
        return self in (ModelStatus.LOADING, ModelStatus.LOADED, ModelStatus.SLEEPING)
