"""One soak run: start everything, run the conversations and the schedule, check, report, clean up.

Every process and mount the run makes is registered in one :class:`contextlib.ExitStack` the moment it
exists, so whatever ends the run (an invariant, an error, Ctrl-C, SIGTERM) leaves nothing behind.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import math
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from bench.beds import llamabed, s3bed
from bench.soak import agents, faults, invariants, product, report, schedule
from sidecar.blocks import blockdir, recipedir
from sidecar.core import errors
from sidecar.observe import memory
from tests.support import agents as sdk_agents
from tests.support import mounts

CONVERSATIONS = 3 * product.SLOTS
"""Conversations at a time: more than the slots, so the library swaps them."""
WORKERS = 3
"""Clients sending turns at once."""
BURST = 2 * product.SLOTS + 1
"""New conversations a burst starts."""
KV_EVERY = 3
"""A Chat Completions turn is checked against the reference every this many turns, and after every fault."""
SAVE_HOLD = 2.0
IDLE = 2.0
"""The sidecar's default --idle-seconds."""
ALLOWANCE = IDLE + SAVE_HOLD + 4.0
"""Seconds before a ``kill -9`` whose turns it may cost: the idle wait, the save hold, a poll and the save."""
STORE_DISK = "768m"
BUDGET = 384 << 20
"""--max-bytes: the store's byte budget (a burst goes past it)."""
SAMPLE_EVERY = 2.0
THINK = (0.2, 1.5)
"""Seconds a client waits between two turns of its own."""


@dataclasses.dataclass(slots=True)
class Tally:
    turns: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    errors: list[str] = dataclasses.field(default_factory=list)
    errors_allowed: int = 0
    errors_cut: list[str] = dataclasses.field(default_factory=list)
    """Errors of answers under way when llama-server was killed (see :data:`report.Figures.errors_cut`)."""
    kv_checks: int = 0
    kv_wrong: list[str] = dataclasses.field(default_factory=list)
    kv_worst: float = 0.0
    reuse_beyond: int = 0
    peaks: dict[str, float] = dataclasses.field(default_factory=dict)
    rss: list[tuple[float, int, float]] = dataclasses.field(default_factory=list)
    """(time, sidecar start, RSS) samples."""
    notes: list[str] = dataclasses.field(default_factory=list)
    history: list[dict[str, float | int | str]] = dataclasses.field(default_factory=list)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


class Run:
    def __init__(self, *, seed: int, minutes: float, say: Callable[[str], None], clients: int = WORKERS) -> None:
        self._seed, self._minutes, self._say, self._clients = seed, minutes, say, clients
        self._events = schedule.plan(seed, minutes * 60.0)
        self._tally = Tally()
        self._rng = random.Random(seed + 1)
        self._stop = threading.Event()
        self._agents: list[agents.Agent] = []
        self._busy: set[int] = set()
        self._pool_lock = threading.Lock()
        self._next_n = 0
        self._start = 0.0
        self._clock: Callable[[], float] = lambda: time.monotonic() - self._start
        self._doer: faults.Faults | None = None
        self._reference = ""
        self._shared = ""
        self._window = 0
        """The model's sliding window (llama-server runs without ``--swa-full``, as users run it)."""
        self.work: Path | None = None
        """The run's files: logs, slot files, the store's disk, the S3 server's data."""

    def run(self, stack: contextlib.ExitStack) -> report.Figures:
        work = self.work = Path(tempfile.mkdtemp(prefix="llama-kv-soak-"))
        self._say(
            f"soak: seed {self._seed}, {self._minutes:g} min, {len(self._events)} faults scheduled; files in {work}"
        )
        binary, model = llamabed.cached_binary(), llamabed.model_path()
        window = memory.window_of_file(str(model))
        self._window = 0 if window is None else window.size
        s3 = s3bed.S3Server(work / "s3")
        stack.callback(s3.stop)
        s3.start()
        s3.create_bucket(product.BUCKET)
        disk = stack.enter_context(mounts.tmpfs(work / "disk", STORE_DISK))
        store = disk / "store"
        store.mkdir()
        reference = llamabed.LlamaServer(
            binary, model, n_slots=1, ctx_size=product.CTX_PER_SLOT, log_dir=work, metrics=False
        )
        stack.callback(reference.kill)
        reference.start()
        rig = product.Product(
            binary=binary, model=model, work=work, store=store, s3_env=s3.env(), max_bytes=BUDGET, save_hold=SAVE_HOLD
        )
        stack.callback(rig.close)
        stack.callback(sdk_agents.close_all)
        rig.start()
        reference.wait_healthy()
        rig.wait_ready()
        self._reference = reference.url
        shared = agents.preamble(reference.url, self._seed)
        self._shared = shared
        self._rig = rig
        for _ in range(CONVERSATIONS):
            self._add()
        doer = faults.Faults(
            rig=rig, s3=s3, disk=disk, clock=self._now, say=self._say, leave=self._leave, burst=self._burst
        )
        stack.callback(doer.undo_all)
        self._doer = doer
        self._start = time.monotonic()
        threads = [threading.Thread(target=self._client, name=f"client-{i}", daemon=True) for i in range(self._clients)]
        threads.append(threading.Thread(target=self._sampler, name="sampler", daemon=True))
        for thread in threads:
            thread.start()
        try:
            self._schedule(doer)
        finally:
            self._stop.set()
            doer.undo_all()
            doer.settle()
            for thread in threads:
                thread.join(timeout=900)
        code, took = rig.sigterm()
        doer.seen.sigterm_status.append(code)
        self._say(f"final SIGTERM: exit status {code} after {took:.1f} s")
        left = product.servers_of(rig.slot_dir)
        doer.seen.orphans += len(left)
        verify = subprocess.run(
            [sys.executable, "-m", "sidecar", "verify", "--slot-dir", str(rig.slot_dir), "--store-dir", str(store)],
            capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        summary = (verify.stdout.strip().splitlines() or [verify.stderr.strip()[-300:]])[-1]
        seen = doer.seen
        return report.Figures(
            seed=self._seed,
            minutes=self._minutes,
            events=self._events,
            faults_done=dict(seen.done),
            faults_skipped=dict(seen.skipped),
            turns=dict(self._tally.turns),
            errors_allowed=self._tally.errors_allowed,
            errors_cut=self._tally.errors_cut,
            clients=self._clients,
            errors=self._tally.errors,
            kv_checks=self._tally.kv_checks,
            kv_wrong=self._tally.kv_wrong,
            kv_worst=self._tally.kv_worst,
            reuse_beyond=self._tally.reuse_beyond,
            peaks=self._tally.peaks,
            breaches=invariants.breaches(self._tally.peaks, invariants.Bounds(), BUDGET),
            orphans=seen.orphans,
            sigterm_status=seen.sigterm_status,
            back_seconds=seen.back_seconds,
            verify_status=verify.returncode,
            verify_summary=summary,
            store=store_check(store),
            budget=BUDGET,
            notes=[*seen.notes, *self._tally.notes],
            rss_growth=self._rss_growth(),
            history=self._tally.history,
            windows=[
                {"fault": w.fault.value, "at": w.at, "until": w.until if math.isfinite(w.until) else None}
                for w in seen.windows_now()
            ],  # None: still on when the run ended (JSON has no infinity)
        )

    def _now(self) -> float:
        return self._clock()

    # ---- the schedule ---------------------------------------------------------------------

    def _schedule(self, doer: faults.Faults) -> None:
        steps: list[tuple[float, int, schedule.Event]] = []
        for event in self._events:
            steps.append((event.at, 1, event))
            if event.seconds:
                steps.append((event.at + event.seconds, 0, event))
        steps.sort(key=lambda step: (step[0], step[1]))
        for at, begins, event in steps:
            wait = at - self._clock()
            if wait > 0:
                time.sleep(wait)
            if begins:
                doer.begin(event)
            else:
                doer.end(event)
        time.sleep(max(0.0, self._minutes * 60.0 - self._clock()))

    # ---- the clients ----------------------------------------------------------------------

    def _add(self) -> agents.Agent:
        with self._pool_lock:
            n = self._next_n
            self._next_n += 1
        agent = agents.new_agent(self._rig.url, self._reference, self._shared, n, self._seed)
        with self._pool_lock:
            self._agents.append(agent)
        return agent

    def _take(self, chat_only: bool = False) -> agents.Agent | None:
        with self._pool_lock:
            idle = [
                a for a in self._agents
                if not a.retired and a.conversation.n not in self._busy
                and (not chat_only or isinstance(a.api, agents.ProbedChat))
            ]  # fmt: skip
            if not idle:
                return None
            fresh = [a for a in idle if not a.done]
            agent = fresh[0] if fresh else self._rng.choice(idle)
            self._busy.add(agent.conversation.n)
            return agent

    def _give(self, agent: agents.Agent) -> None:
        with self._pool_lock:
            self._busy.discard(agent.conversation.n)
            live = [a for a in self._agents if not a.retired]
        if agent.retired and len(live) < CONVERSATIONS:
            self._add()

    def _client(self) -> None:
        rng = random.Random(self._rng.random())
        while not self._stop.is_set():
            agent = self._take()
            if agent is None:
                time.sleep(0.1)
                continue
            try:
                self._turn(agent, rng)
            finally:
                self._give(agent)
            time.sleep(rng.uniform(*THINK))

    def _turn(self, agent: agents.Agent, rng: random.Random) -> None:
        windows_before = len(self._tally_windows())
        sent = agent.send(self._clock)
        if sent.reply is None or not sent.reply.complete:
            why = sent.error or "the answer did not end as its API ends one"
            agent.failed = True
            outages = self._doer_outages()
            with self._tally.lock:
                if invariants.error_allowed(sent.started, sent.ended, outages):
                    self._tally.errors_allowed += 1
                elif invariants.error_allowed(sent.started, sent.ended, self._server_kills()):
                    self._tally.errors_cut.append(f"{sent.started:.1f}-{sent.ended:.1f} s conversation "
                                                 f"{agent.conversation.n} ({agent.api.name}): {why}")  # fmt: skip
                else:
                    self._say(f"{sent.ended:7.1f} s  conversation {agent.conversation.n}: ERROR {why}")
                    self._tally.errors.append(f"{sent.started:.1f}-{sent.ended:.1f} s conversation "
                                             f"{agent.conversation.n} ({agent.api.name}): {why}")  # fmt: skip
            return
        windows = self._tally_windows()
        verdict = invariants.classify(
            agent.done,
            started=sent.started,
            ended=sent.ended,
            cached=sent.reply.cached,
            windows=windows,
            allowance=ALLOWANCE,
            window=self._window,
        )
        beyond = invariants.reuse_beyond_history(
            agent.done, sent.reply.cached, again=sent.reply.prompt if agent.failed else 0
        )
        self._say(
            f"{sent.ended:7.1f} s  conversation {agent.conversation.n:<3} {agent.api.name:<19} "
            f"reused {sent.reply.cached:>5} of {sent.reply.prompt:>5}: {verdict.value}"
        )
        with self._tally.lock:
            self._tally.turns[verdict] += 1
            self._tally.history.append(
                {
                    "conversation": agent.conversation.n,
                    "started": round(sent.started, 3),
                    "ended": round(sent.ended, 3),
                    "cached": sent.reply.cached,
                    "prompt": sent.reply.prompt,
                    "verdict": verdict.value,
                }
            )
            self._tally.reuse_beyond += beyond
            if verdict is invariants.Verdict.LOST:
                self._tally.notes.append(
                    f"LOST: {sent.started:.1f} s conversation {agent.conversation.n} ({agent.api.name}) reused "
                    f"{sent.reply.cached} of {sent.reply.prompt}; its previous prompt {agent.done[-1].prompt}"
                )
        due = len(agent.done) % KV_EVERY == 0 or len(windows) > windows_before or verdict is not invariants.Verdict.WARM
        if sent.body is not None and sent.top and due:
            self._check_kv(agent, sent)
        agent.answered(sent, rng)

    def _check_kv(self, agent: agents.Agent, sent: agents.Sent) -> None:
        assert sent.body is not None
        assert sent.reply is not None
        try:
            want = agents.reference_top(self._reference, sent.body)
        except (OSError, RuntimeError) as exc:
            with self._tally.lock:
                self._tally.notes.append(f"a reference check failed: {exc}")
            return
        if not want:
            return
        moved = invariants.kv_distance(sent.top, want)
        with self._tally.lock:
            self._tally.kv_checks += 1
            self._tally.kv_worst = max(self._tally.kv_worst, moved)
            if moved > invariants.WRONG_KV:
                self._tally.kv_wrong.append(
                    f"{sent.started:.1f} s conversation {agent.conversation.n}: the first token's distribution "
                    f"moved {moved:.3f} "
                    f"(reused {sent.reply.cached} of {sent.reply.prompt}); product {sent.top}, reference {want}"
                )

    def _tally_windows(self) -> list[invariants.Window]:
        return self._doer.seen.windows_now() if self._doer is not None else []

    def _server_kills(self) -> list[tuple[float, float]]:
        return [(w.at, w.at) for w in self._tally_windows() if w.fault is schedule.Fault.SERVER_KILL]

    def _doer_outages(self) -> list[tuple[float, float]]:
        return self._doer.outages_now(self._clock()) if self._doer is not None else []

    def _leave(self) -> str | None:
        agent = self._take(chat_only=True)
        if agent is None:
            return None
        try:
            return f"conversation {agent.conversation.n}: " + agents.leave_mid_stream(self._rig.url, agent)
        finally:
            self._give(agent)

    def _burst(self) -> int:
        for _ in range(BURST):
            self._add()
        return BURST

    # ---- resources ------------------------------------------------------------------------

    def _sampler(self) -> None:
        while not self._stop.wait(SAMPLE_EVERY):
            try:
                self._sample()
            except Exception as exc:  # a sample lost is said, and the next one is taken
                with self._tally.lock:
                    self._tally.notes.append(f"a resource sample failed: {exc.__class__.__name__}: {exc}")

    def _sample(self) -> None:
        now = dict(self._rig.usage())
        staged = self._rig.metric("llama_sidecar_store_staged_bytes")
        if staged is not None:
            now["staged_bytes"] = staged
        now["store_bytes"] = float(product.store_bytes(self._rig.store))
        with self._tally.lock:
            for name, value in now.items():
                self._tally.peaks[name] = max(self._tally.peaks.get(name, 0.0), value)
            if "rss_bytes" in now:
                self._tally.rss.append((self._clock(), self._rig.starts, now["rss_bytes"]))

    def _rss_growth(self) -> float | None:
        """RSS at the end over RSS as the steady stretch began, of the one sidecar process between."""
        with self._tally.lock:
            samples = list(self._tally.rss)
        return invariants.rss_growth(samples, schedule.steady_from(self._minutes * 60.0))


def store_check(root: Path) -> dict[str, int]:
    """The block store after the run: referenced blocks missing, unreadable recipes, blocks no recipe names."""
    recipes = recipedir.RecipeDir(root / "recipes")
    referenced: set[str] = set()
    unreadable = 0
    for name in recipes.names():
        try:
            referenced |= recipes.read(name).digests()
        except errors.BlockStoreError:
            unreadable += 1
    present = {digest for digest, _, _ in blockdir.BlockDir(root / "blocks").entries() if digest}
    return {
        "recipes": len(recipes.names()),
        "blocks": len(present),
        "missing": len(referenced - present),
        "unreadable": unreadable,
        "unreferenced": len(present - referenced),
    }


def main(*, seed: int, minutes: float, out: Path | None, clients: int = WORKERS) -> int:
    """Run, print the report; 1 when an invariant was missed, 2 when a prerequisite is missing."""

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    lacking = product.missing()
    if lacking:
        for line in lacking:
            say(f"bench.soak: cannot run: {line}")
        return 2
    with contextlib.ExitStack() as stack:
        run = Run(seed=seed, minutes=minutes, say=say, clients=clients)
        figures = run.run(stack)
    text = report.render(figures)
    print(text, flush=True)
    if out is not None:
        out.write_text(json.dumps(report.as_json(figures), indent=1, default=str))
    met = all(report.verdicts(figures).values())
    if run.work is not None:
        say(tidy(run.work, met=met))
    return 0 if met else 1


def tidy(work: Path, *, met: bool) -> str:
    """After a run that met every goal, only the logs stay in ``work`` (its slot files and S3 data can reach
    gigabytes); after a MISSED one, everything stays for a look. What was done, said in a line."""
    if not met:
        return f"soak: every file of the run kept in {work} (logs, slot files, S3 data): remove it once read"
    for entry in work.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        elif entry.suffix != ".log":
            entry.unlink(missing_ok=True)
    return f"soak: logs kept in {work}; its slot files and S3 data were removed (every goal met)"
