"""What the sidecar does with each observation: log, count, restore, save.

The :class:`Engine` is the consumer of the poller. It is the only place
that holds the state of the current server process (its identity, the
slots restored into it, whether its slot dir link has been proven) and it
calls the pure policy for decisions and the snapshotter and restorer for
effects. Observations are handled one at a time, so actions never overlap.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog

from sidecar import config, errors, events, metrics, policy, report, restorer, snapshotter, store, upstream
from sidecar.proxy import gate

log = structlog.get_logger("sidecar.engine")
RETRY_AFTER = 30.0
"""Seconds before a slot whose save failed, or was skipped for lack of disk, is tried again."""


class Engine:
    def __init__(
        self,
        *,
        client: upstream.LlamaClient,
        snapshots: store.SnapshotStore,
        stats: metrics.Metrics,
        settings: config.Settings,
        mono: Callable[[], float] = time.monotonic,
        restore_gate: gate.Gate | None = None,
    ) -> None:
        s = settings.snapshots
        self._client = client
        self._store = snapshots
        self._metrics = stats
        self._mono = mono
        self._down_interval = settings.poll.down_interval
        self.policy = policy.Policy(s)
        self.saver = snapshotter.Snapshotter(client=client, snapshots=snapshots, stats=stats, settings=s)
        self.restorer = restorer.Restorer(
            client=client, snapshots=snapshots, stats=stats, lock=self.saver.lock, mono=mono
        )
        self.latest: events.Observation | None = None
        self.identity: events.Identity | None = None
        self.healthy_at: float | None = None
        self.restore_due = True
        """A restore round is owed: at start-up, and after each detected restart."""
        self.link_ok: bool | None = None
        """Whether the server is known to write into our slot dir (None: not yet known)."""
        self.link_problem = ""
        self._first = True
        self._slot_count = 0
        self._said: events.Health | None = None
        self._handled_at = mono()
        self.gate = restore_gate or gate.Gate(mono=mono)
        """Closed while the server is down or loading and while a restore round is owed or running."""

    def status(self) -> report.Status:
        """What the engine knows now, for the HTTP layer."""
        latest = self.latest
        return report.Status(
            server_url=self._client.url,
            observation=latest,
            identity=self.identity,
            link_ok=self.link_ok,
            link_problem=self.link_problem,
            last_snapshot=self.saver.last,
            last_restore=tuple(self.restorer.last),
            progress_at=self._handled_at,
            acting=self.saver.lock.locked(),
            restore_gate=self.gate.reason,
        )

    async def save_now(self, slot: int) -> report.SaveReply | None:
        """An admin's save of ``slot``; None when the newest poll shows no such slot holding tokens."""
        view = self.latest.slot(slot) if self.latest is not None else None
        if view is None or view.signature is None:
            return None
        ok = await self.save(policy.Save(view.id, view.signature, view.tokens, policy.SaveReason.MANUAL))
        return report.SaveReply(ok, self.saver.last)

    async def restore_now(self) -> list[restorer.RestoreRecord]:
        """An admin's restore round into the slots that are empty now."""
        obs = self.latest
        if obs is None or obs.slots is None or self.identity is None:
            return []
        await self.restorer.restore_all(obs.slots, self.identity, healthy_at=None, counters=obs.counters)
        return self.restorer.last

    async def handle(self, obs: events.Observation, evts: list[events.Event]) -> None:
        try:
            await self._handle(obs, evts)
        finally:
            self._handled_at = self._mono()  # the loop made progress: see report.Liveness

    async def _handle(self, obs: events.Observation, evts: list[events.Event]) -> None:
        if obs.health is not self._said:
            self._say_state(obs)
        self._metrics.server_readable.set(0 if obs.denied else 1)
        if obs.health is not events.Health.OK:
            self.gate.close(f"llama-server is {obs.health.value}")
        for event in evts:
            self._on_event(event, obs)
        self.latest = obs
        if obs.identity is not None:
            self.identity = obs.identity
        if obs.health is not events.Health.OK or obs.slots is None or self.identity is None or obs.sleeping:
            if obs.health is events.Health.OK:
                self.gate.open(seen_at=obs.at)  # up, but nothing the sidecar can restore now
            return  # asleep: its slots look empty, and any slot action would wake it
        if len(obs.slots) != self._slot_count:
            self._slot_count = len(obs.slots)
            self._metrics.init_slots(range(self._slot_count))
        if self._first:
            self._first = False
            self._adopt_existing(obs.slots)
        self.policy.observe(obs.slots, obs.at)
        if self.restore_due:
            self.restore_due = False
            await self._restore(obs)
        self.gate.open(seen_at=obs.at)
        if self.restorer.pending:
            self.restorer.verify(obs.slots, obs.counters)
        if self.link_ok is None:
            await self._probe(obs.slots)
        for action in self.policy.due(self._mono()):
            await self._act(action, obs)

    def _on_event(self, event: events.Event, obs: events.Observation) -> None:
        kind = event.transition
        if kind is events.Transition.CAME_UP:
            self._metrics.server_up.set(1)
            self.healthy_at = event.at
        elif kind is events.Transition.WENT_DOWN:
            self._metrics.server_up.set(0)
        elif kind is events.Transition.RESTARTED:
            self._metrics.server_restarts.inc()
            log.warning("server_restarted", reasons=list(event.reasons))
            self._slots_emptied(event.at)
            self.link_ok = None  # the new process may have another --slot-save-path
        elif kind is events.Transition.SLEPT:
            log.info(
                "server_sleeping",
                effect="llama-server unloaded the model and the KV (--sleep-idle-seconds); the sidecar "
                "leaves it asleep and restores idle slots once a request wakes it",
            )
        elif kind is events.Transition.WOKE:
            log.info("server_woke", effect="its slots start empty: restoring the idle ones")
            self._slots_emptied(event.at)
        elif kind is events.Transition.BECAME_BUSY:
            log.debug("slot_busy", slot=event.slot)
        elif kind is events.Transition.BECAME_IDLE:
            log.debug("slot_idle", slot=event.slot, changed=event.changed)

    def _slots_emptied(self, at: float) -> None:
        """The server lost every slot's KV (a new process, or a wake-up): start over and restore.

        ``at`` is the poll that first saw the server healthy again, where the
        restart-to-restore latency starts.
        """
        self.policy.reset()
        self.restorer.pending.clear()
        self.restore_due = True
        self.healthy_at = at
        self.gate.close("a restore round is owed: llama-server lost its slots (restart or wake-up)")

    def _say_state(self, obs: events.Observation) -> None:
        """Log the server's state once per change, not on every poll."""
        self._said = obs.health
        if obs.health is events.Health.OK:
            log.info("server_up", server=self._client.url)
        elif obs.health is events.Health.LOADING:
            log.info("server_loading", server=self._client.url, problem=obs.problem)
        else:
            log.warning(
                "server_unreachable",
                server=self._client.url,
                problem=obs.problem,
                effect=f"no snapshots or restores until it answers; retrying every {self._down_interval} s",
                hint="check --server / LLAMA_SIDECAR_SERVER and that llama-server is running",
            )

    def _adopt_existing(self, slots: tuple[events.SlotView, ...]) -> None:
        """At start-up, treat slots whose content matches their newest snapshot as saved."""
        for view in slots:
            newest = next(iter(self._store.snapshots(view.id)), None)
            if newest is None or view.task is None:
                continue
            if newest.task == view.task and newest.tokens == view.tokens:
                self.policy.settle(view.id, view.signature)
                log.info("slot_already_saved", slot=view.id, file=newest.file)

    async def _restore(self, obs: events.Observation) -> None:
        assert obs.slots is not None
        assert self.identity is not None
        if not self._store.snapshots():
            return
        done = await self.restorer.restore_all(
            obs.slots, self.identity, healthy_at=self.healthy_at, counters=obs.counters
        )
        if done:
            self.link_ok = True

    async def _probe(self, slots: tuple[events.SlotView, ...]) -> None:
        """Prove once per server process that the server writes into our slot dir."""
        target = next((v for v in slots if v.virgin and not v.processing and v.id not in self.restorer.pending), None)
        if target is None:
            return  # the first real save will prove or disprove the link
        async with self.saver.lock:  # a probe is a save: never two in flight
            await self._probe_slot(target.id)

    async def _probe_slot(self, slot: int) -> None:
        name = self._store.probe_name()
        try:
            await self._client.save(slot, name)
        except errors.UpstreamNotSupported:
            self._link(
                False,
                "llama-server refuses slot saves (HTTP 501): start it with "
                f"--slot-save-path {self._store.dir} (the sidecar's --slot-dir, same directory)",
            )
            return
        except errors.UpstreamError as exc:
            log.warning("slot_dir_probe_failed", error=str(exc))
            return
        seen = await asyncio.to_thread(self._store.exists, name)
        await asyncio.to_thread(self._store.remove, name)
        if seen:
            self._link(True, "")
        else:
            self._link(
                False,
                f"llama-server saved a probe file that did not appear in {self._store.dir}: "
                "--slot-dir must be the directory llama-server was given as --slot-save-path "
                "(the same volume, seen from both)",
            )

    def _link(self, ok: bool, problem: str) -> None:
        self.link_ok, self.link_problem = ok, problem
        if ok:
            log.info("slot_dir_linked", slot_dir=str(self._store.dir))
        else:
            log.error("slot_dir_not_linked", problem=problem)

    async def _act(self, action: policy.Save | policy.Skip, obs: events.Observation) -> None:
        if isinstance(action, policy.Skip):
            self.saver.skip(action)
            self.policy.settle(action.slot, action.signature)
            return
        await self.save(action, obs)

    async def save(self, action: policy.Save, obs: events.Observation | None = None) -> bool:
        obs = obs or self.latest
        if self.identity is None or obs is None:
            log.warning("snapshot_postponed", slot=action.slot, reason="server identity (/props) not read yet")
            return False
        view = obs.slot(action.slot)
        n_ctx = view.n_ctx if view else self.identity.n_ctx
        record = await self.saver.save(action, identity=self.identity, slot_n_ctx=n_ctx)
        last = self.saver.last
        if record is not None:
            self.link_ok = True
            self.policy.settle(action.slot, action.signature)
        elif last is not None and last.result == "skipped" and "empty" in last.detail:
            self.policy.settle(action.slot, action.signature)
        elif last is not None and last.result == "skipped":  # disk below the floor: try again later
            self.policy.defer(action.slot, self._mono() + RETRY_AFTER)
        elif last is not None and last.result == "failed":
            self.policy.defer(action.slot, self._mono() + RETRY_AFTER)
            if "--slot-dir must be" in last.detail:
                self._link(False, last.detail)
        return record is not None

    async def final_snapshots(self) -> None:
        """Save every changed slot once more before the process exits."""
        actions = self.policy.final()
        if not actions:
            log.info("final_snapshot_nothing_to_save")
        for action in actions:
            await self.save(action)
