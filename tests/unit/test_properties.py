"""Properties of restart detection, the snapshot policy and retention under random histories (hypothesis).

A small model of llama-server (slots that get tasks, finish them, are cleared
by --cache-idle-slots; the server going down, coming back, restarting,
sleeping) is driven by random operations. The real ``poller.Poller`` polls
it through a fake client, so ``events.detect`` sees exactly the observations
it sees in production (with /slots reads skipped when /metrics shows no
activity, and ``was_down`` carried across polls); the sink then drives
``policy.Policy`` as the engine does and checks the invariants after every poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
from pathlib import Path
from typing import cast

import structlog
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar.core import config, errors, events, hashing, outcomes, protocols
from sidecar.observe import poller
from sidecar.restore import plan
from sidecar.save import policy
from sidecar.snapshots import manifest
from tests.support import clocks

TIMING = config.SnapshotSettings(slot_dir=Path("slots"), idle_seconds=2.0, interval=10.0, min_tokens=100)
RETRY_AFTER = 30.0
N_CTX = 4096
PROFILE = settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


# ---- the model of llama-server -------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Tick:
    dt: float


@dataclasses.dataclass(frozen=True)
class Start:
    """A request arrives on a slot and is still running at the next poll."""

    slot: int
    tokens: int


@dataclasses.dataclass(frozen=True)
class Finish:
    slot: int
    generated: int


@dataclasses.dataclass(frozen=True)
class Quick:
    """A request starts and finishes between two polls."""

    slot: int
    tokens: int


@dataclasses.dataclass(frozen=True)
class Clear:
    """--cache-idle-slots moves an idle slot's tokens to RAM: tokens 0, same id_task."""

    slot: int


@dataclasses.dataclass(frozen=True)
class GoDown:
    loading: bool


@dataclasses.dataclass(frozen=True)
class ComeUp:
    pass


@dataclasses.dataclass(frozen=True)
class Restart:
    """A new server process: empty slots, task ids and counters from zero."""

    seen_down: bool
    new_build: bool


@dataclasses.dataclass(frozen=True)
class Blind:
    """The next /slots read fails (timeout)."""


@dataclasses.dataclass(frozen=True)
class Sleep:
    """--sleep-idle-seconds: the model and every slot's KV are unloaded, same process."""


@dataclasses.dataclass(frozen=True)
class Poke:
    """Someone else reads /slots (or a request is cancelled during the reload): a sleeping
    server wakes, its slots empty, without any token activity in /metrics."""


Op = Tick | Start | Finish | Quick | Clear | GoDown | ComeUp | Restart | Blind | Sleep | Poke

slot_ids = st.integers(0, 3)
SLOT_OPS = st.one_of(
    st.builds(Tick, st.floats(0.0, 15.0)),
    st.builds(Start, slot_ids, st.integers(1, 3000)),
    st.builds(Finish, slot_ids, st.integers(0, 500)),
    st.builds(Quick, slot_ids, st.integers(1, 3000)),
    st.builds(Clear, slot_ids),
)
SERVER_OPS = st.one_of(
    st.builds(GoDown, st.booleans()),
    st.just(ComeUp()),
    st.builds(Restart, st.booleans(), st.booleans()),
    st.just(Blind()),
    st.just(Sleep()),
)
OPS = st.one_of(SLOT_OPS, SLOT_OPS, SERVER_OPS)
"""Slot activity twice as likely as server events, so slots fill up between restarts."""


@dataclasses.dataclass
class Server:
    n_slots: int
    metrics: bool
    start_header: bool
    at: float = 0.0
    health: events.Health = events.Health.OK
    sleeping: bool = False
    process: int = 0
    next_task: int = 0
    prompt_total: float = 0.0
    cached_total: float = 0.0
    decodes: float = 0.0
    build: int = 0
    blind: bool = False
    slots: list[events.SlotView] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self._empty()

    def _empty(self) -> None:
        self.slots = [
            events.SlotView(id=i, n_ctx=N_CTX, processing=False, task=None, tokens=0) for i in range(self.n_slots)
        ]

    @property
    def up(self) -> bool:
        return self.health is events.Health.OK

    def apply(self, op: Op) -> None:
        if isinstance(op, Tick):
            self.at += op.dt
            return
        self.at += 0.5
        if isinstance(op, GoDown) and self.up:
            self.health = events.Health.LOADING if op.loading else events.Health.DOWN
        elif isinstance(op, ComeUp):
            self.health = events.Health.OK
        elif isinstance(op, Restart):
            self.process += 1
            self.next_task = 0
            self.prompt_total = self.cached_total = self.decodes = 0.0
            self.build += int(op.new_build)
            self.sleeping = False
            self._empty()
            self.health = events.Health.DOWN if op.seen_down else events.Health.OK
        elif isinstance(op, Blind):
            self.blind = True
        elif isinstance(op, Sleep):
            if self.up and not any(v.processing for v in self.slots):
                self.sleeping = True
                self._empty()
        elif isinstance(op, Poke):
            self.sleeping = False
        elif self.up:
            if self.sleeping:  # a request wakes a sleeping server: that is activity in /metrics
                self.sleeping = False
                self.decodes += 1
            self._slot_op(op)

    def _slot_op(self, op: Op) -> None:
        assert isinstance(op, Start | Finish | Quick | Clear)
        i = op.slot % self.n_slots
        view = self.slots[i]
        if isinstance(op, Start | Quick) and not view.processing:
            task, self.next_task = self.next_task, self.next_task + 1
            self.prompt_total += op.tokens
            self.cached_total += min(op.tokens, view.tokens) / 2
            self.decodes += 1
            tokens = min(op.tokens, N_CTX)
            self.slots[i] = dataclasses.replace(view, processing=isinstance(op, Start), task=task, tokens=tokens)
        elif isinstance(op, Finish) and view.processing:
            self.decodes += 1
            self.slots[i] = dataclasses.replace(view, processing=False, tokens=min(view.tokens + op.generated, N_CTX))
        elif isinstance(op, Clear) and not view.processing and view.task is not None:
            self.slots[i] = dataclasses.replace(view, tokens=0)


class ModelClient:
    """The slice of upstream.LlamaClient the poller calls, answered by the model."""

    url = "http://model"

    def __init__(self, server: Server) -> None:
        self.server = server

    def _check_up(self, endpoint: str) -> None:
        if not self.server.up:
            raise errors.UpstreamUnavailable(f"{endpoint}: connection refused", endpoint=endpoint)

    async def health(self) -> tuple[events.Health, str]:
        return self.server.health, "" if self.server.up else "unreachable"

    async def props(self) -> tuple[events.Identity, bool]:
        self._check_up("/props")
        s = self.server
        return events.Identity(f"b{s.build}", "/m.gguf", s.n_slots, N_CTX), s.sleeping

    async def model_meta(self) -> tuple[int | None, int | None]:
        return None, None

    async def adapters(self) -> tuple[events.Adapter, ...] | None:
        self._check_up("/lora-adapters")
        assert not self.server.sleeping, "/lora-adapters wakes a sleeping server"
        return ()

    async def counters(self) -> events.Counters:
        self._check_up("/metrics")
        s = self.server
        if not s.metrics:
            raise errors.UpstreamNotSupported("/metrics: HTTP 501", endpoint="/metrics", status=501)
        return events.Counters(
            start_time=1_700_000_000.0 + s.process if s.start_header else None,
            prompt_tokens=s.prompt_total,
            cached_tokens=s.cached_total,
            activity=(s.decodes, s.prompt_total, s.cached_total),
            processing=float(sum(v.processing for v in s.slots)),
        )

    async def slots(self) -> tuple[events.SlotView, ...]:
        self._check_up("/slots")
        assert not self.server.sleeping, "the poller read /slots of a sleeping server: that wakes it"
        if self.server.blind:
            self.server.blind = False
            raise errors.UpstreamUnavailable("/slots: no answer within 5 s", endpoint="/slots")
        return tuple(self.server.slots)


def _manifest(slot: int, created: float, tokens: int, identity: events.Identity) -> manifest.Manifest:
    stamp = datetime.datetime.fromtimestamp(1_700_000_000 + created, datetime.UTC).strftime("%Y%m%dT%H%M%S%fZ")
    return manifest.Manifest(
        slot=slot,
        file=f"slot{slot}-{stamp}.bin",
        tokens=tokens,
        bytes=tokens * 5000,
        checksum=manifest.Checksum(hashing.Algorithm.SHA256, "0" * 64),
        generation=int(created),
        created=created,
        task=None,
        fingerprint=manifest.Fingerprint.of(identity, n_ctx=N_CTX),
    )


class Done(Exception):
    """Every operation has been applied."""


class Checker:
    """The poller's sink: checks detect's output, then acts as the engine does, then moves the model on."""

    def __init__(self, server: Server, watcher: poller.Poller, steps: list[tuple[Op, bool]]) -> None:
        self.server = server
        self.watcher = watcher
        self.steps = iter(steps)
        self.policy = policy.Policy(TIMING)
        self.baseline: events.Observation | None = None
        """``last_up`` as the poller held it before this poll."""
        self.baseline_process = 0
        self.busy_unseen = False
        self.slept_since_baseline = False
        """The modelled server slept at some point since the baseline observation."""
        """A request ran in a new process before any poll read its slots: a restart may be invisible then."""
        self.epoch = 0
        self.saved: set[tuple[int, int, tuple[int, int]]] = set()
        self.snapshots: dict[int, list[manifest.Manifest]] = {}
        self.save_fails = False
        self.woken: events.Observation | None = None
        """The observation of the last wake-up."""
        self.seen: list[list[events.Transition]] = []
        """The transitions of every poll."""

    async def sink(self, obs: events.Observation, evts: list[events.Event]) -> None:
        self.seen.append([e.transition for e in evts])
        self.check_detect(obs, evts)
        self.act_like_engine(obs, evts)
        if self.watcher.last_up is None:
            self.baseline = None
        elif self.watcher.last_up is obs:
            self.baseline, self.baseline_process, self.busy_unseen = obs, self.server.process, False
            self.slept_since_baseline = False
        try:
            op, self.save_fails = next(self.steps)
        except StopIteration:
            raise Done from None
        slots_before = list(self.server.slots)
        self.server.apply(op)
        self.slept_since_baseline |= self.server.sleeping
        if self.server.process > self.baseline_process and not isinstance(op, Restart):
            self.busy_unseen |= self.server.slots != slots_before

    def check_detect(self, obs: events.Observation, evts: list[events.Event]) -> None:
        kinds = [e.transition for e in evts]
        if events.Transition.WOKE in kinds:
            self.woken = obs
        base = self.baseline
        restarted = events.Transition.RESTARTED in kinds
        # No restart invented (a slot cleared by --cache-idle-slots, a pause, a blip) ...
        if restarted:
            assert base is not None
            assert base.slots is not None
            assert (
                self.server.process > self.baseline_process
                or all(v.virgin for v in base.slots)
                # A sleep and wake between two polls looks like a restart when the server
                # sends no process start time: the sidecar cannot tell, and restores either way.
                or (self.slept_since_baseline and not (self.server.metrics and self.server.start_header))
            ), evts
        # ... and none missed once a slot had run a task.
        if (
            base is not None
            and self.server.process > self.baseline_process
            and not self.busy_unseen
            and obs.slots is not None
            and not obs.sleeping
            and events.Transition.WOKE not in kinds
            and any(not v.virgin for v in base.slots or ())
        ):
            assert restarted, (base, obs)

    def act_like_engine(self, obs: events.Observation, evts: list[events.Event]) -> None:
        kinds = [e.transition for e in evts]
        if events.Transition.RESTARTED in kinds or events.Transition.WOKE in kinds:
            self.policy.reset()
            self.epoch += 1
        if obs.health is not events.Health.OK or obs.slots is None or obs.identity is None or obs.sleeping:
            return
        self.policy.observe(obs.slots, obs.at)
        for action in self.policy.due(obs.at):
            view = obs.slot(action.slot)
            assert view is not None
            if isinstance(action, policy.Skip):
                assert action.signature == view.signature
                assert action.signature[1] < TIMING.min_tokens
                self.policy.settle(action.slot, action.signature)
                continue
            assert not view.processing, (action, view)
            assert action.signature == view.signature
            assert action.tokens == view.tokens >= TIMING.min_tokens
            key = (self.epoch, action.slot, action.signature)
            assert key not in self.saved, f"content saved twice: {action}"
            if self.save_fails:
                self.policy.defer(action.slot, obs.at + RETRY_AFTER)
            else:
                self.saved.add(key)
                self.policy.settle(action.slot, action.signature)
                self.snapshots.setdefault(action.slot, []).insert(
                    0, _manifest(action.slot, obs.at, action.tokens, obs.identity)
                )
        for view in obs.slots:  # the restorer's plan, for every slot as it is now
            chosen = plan.plan_restore(view, self.snapshots.get(view.id, []), obs.identity)
            if chosen.candidates:
                assert not view.processing
                assert view.empty, (view, chosen)
                assert chosen.outcome is None
            if view.processing or not view.empty:
                assert chosen.outcome is outcomes.RestoreOutcome.SLOT_BUSY


# ---- the properties ------------------------------------------------------------------


@PROFILE
@given(
    n_slots=st.integers(1, 4),
    metrics=st.booleans(),
    start_header=st.booleans(),
    steps=st.lists(st.tuples(OPS, st.booleans()), min_size=20, max_size=100),
)
def test_random_histories(n_slots: int, metrics: bool, start_header: bool, steps: list[tuple[Op, bool]]) -> None:
    run_history(Server(n_slots=n_slots, metrics=metrics, start_header=start_header), steps)


def run_history(server: Server, steps: list[tuple[Op, bool]]) -> Checker:
    client = cast(protocols.Upstream, ModelClient(server))
    watcher = poller.Poller(
        client, config.PollSettings(interval=0.0, down_interval=0.0), clock=clocks.reading(lambda: server.at)
    )
    checker = Checker(server, watcher, steps)
    with structlog.testing.capture_logs(), contextlib.suppress(Done):
        asyncio.run(watcher.run(checker.sink))
    return checker


def test_quiet_wake_shows_the_empty_slots_and_is_no_restart() -> None:
    # With --metrics the poller re-reads /slots only when /metrics shows activity.
    server = Server(n_slots=2, metrics=True, start_header=False)
    steps: list[tuple[Op, bool]] = [(Quick(0, 500), False), (Sleep(), False), (Poke(), False), (Start(1, 10), False)]
    checker = run_history(server, steps)
    assert checker.woken is not None
    assert checker.woken.slots == tuple(events.SlotView(i, N_CTX, False, None, 0) for i in range(2))


def test_restart_of_a_sleeping_server_is_seen() -> None:
    server = Server(n_slots=2, metrics=True, start_header=True)
    steps: list[tuple[Op, bool]] = [
        (Quick(0, 500), False),
        (Sleep(), False),
        (Restart(seen_down=True, new_build=False), False),
        (ComeUp(), False),
        (Tick(1.0), False),
    ]
    seen = run_history(server, steps).seen
    assert seen[2] == [events.Transition.SLEPT]
    assert seen[3] == [events.Transition.WENT_DOWN]
    back = seen[4]
    assert events.Transition.RESTARTED in back or events.Transition.WOKE in back, back


@st.composite
def cleared_pair(draw: st.DrawFn) -> tuple[tuple[events.SlotView, ...], tuple[events.SlotView, ...]]:
    n = draw(st.integers(1, 4))
    before: list[events.SlotView] = []
    for i in range(n):
        task = draw(st.none() | st.integers(0, 10_000))
        tokens = 0 if task is None else draw(st.integers(0, N_CTX))
        busy = draw(st.booleans())
        before.append(events.SlotView(id=i, n_ctx=N_CTX, processing=busy, task=task, tokens=tokens))
    clearable = [v.id for v in before if v.task is not None and v.tokens > 0 and not v.processing]
    if not clearable:
        task = draw(st.integers(0, 10_000))
        before[0] = events.SlotView(id=0, n_ctx=N_CTX, processing=False, task=task, tokens=draw(st.integers(1, N_CTX)))
        clearable = [0]
    cleared = set(draw(st.lists(st.sampled_from(clearable), min_size=1, unique=True)))
    after = tuple(dataclasses.replace(v, tokens=0) if v.id in cleared else v for v in before)
    return tuple(before), after


@PROFILE
@given(
    pair=cleared_pair(),
    down_between=st.booleans(),
    counters=st.none()
    | st.builds(events.Counters, st.none() | st.just(1_700_000_000.0), st.just(5000.0), st.just(100.0)),
    fresh=st.booleans(),
)
def test_tokens_dropping_to_zero_with_same_task_is_never_a_restart(
    pair: tuple[tuple[events.SlotView, ...], tuple[events.SlotView, ...]],
    down_between: bool,
    counters: events.Counters | None,
    fresh: bool,
) -> None:
    before_slots, after_slots = pair
    identity = events.Identity("b1", "/m.gguf", len(before_slots), N_CTX)
    before = events.Observation(1.0, events.Health.OK, before_slots, identity, counters, counters_fresh=True)
    after = events.Observation(3.0, events.Health.OK, after_slots, identity, counters, counters_fresh=fresh)
    prev = events.Observation(2.0, events.Health.DOWN, problem="unreachable") if down_between else before
    evts = events.detect(prev, after, last_up=before, was_down=down_between)
    assert events.Transition.RESTARTED not in [e.transition for e in evts]
    assert events.restart_reasons(before, after, was_down=down_between) == ()


manifests = st.builds(
    lambda slot, created, size: _manifest(slot, created, max(size // 5000, 1), events.Identity("b", "/m", 4, N_CTX)),
    st.integers(0, 3),
    st.floats(0.0, 1e6, allow_nan=False).map(lambda x: round(x, 3)),
    st.integers(5000, 10**7),
)


@PROFILE
@given(
    snaps=st.lists(manifests, max_size=25, unique_by=lambda m: m.file),
    keep=st.integers(0, 4),
    max_bytes=st.integers(0, 10**8) | st.just(0) | st.just(1),
    max_age=st.floats(0.0, 1e6, allow_nan=False),
    now=st.floats(0.0, 2e6, allow_nan=False),
)
def test_select_for_deletion_never_deletes_a_slots_newest(
    snaps: list[manifest.Manifest], keep: int, max_bytes: int, max_age: float, now: float
) -> None:
    got = policy.select_for_deletion(snaps, keep_per_slot=keep, max_bytes=max_bytes, max_age=max_age, now=now)
    files = [m.file for m, _ in got]
    assert len(files) == len(set(files))
    assert set(files) <= {m.file for m in snaps}
    for slot in {m.slot for m in snaps}:
        newest = max((m for m in snaps if m.slot == slot), key=lambda m: (m.created, m.file))
        assert newest.file not in files
