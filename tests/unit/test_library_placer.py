"""The library's routing over the in-memory server: pins, saves before a slot is given away, swaps, locks."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from prometheus_client import CollectorRegistry

from sidecar.core import config, errors, events, metrics, outcomes, protocols
from sidecar.engine import engine
from sidecar.library import fetching, placer, prompt, ramtier, turns
from sidecar.observe import memory, poller
from sidecar.proxy import answer, tickets
from sidecar.shared import catalog, decide, records
from sidecar.snapshots import manifest, slotfile, store
from tests.support import clocks
from tests.unit import memllama

BLOCK = slotfile.BLOCK_TOKENS
LONG = "and then, " * 20
"""A message that makes a body long enough for the placer to send its /slots read as the request comes in."""


SYSTEM = [900_000 + i for i in range(2 * BLOCK)]
"""A system prompt of two whole blocks, shared by the conversations named ``sys:X``."""


def ids_of(name: str, blocks: int = 3) -> list[int]:
    """A conversation's ids; ``sys:X``: :data:`SYSTEM`, then X's own."""
    if name.startswith("sys:"):
        return SYSTEM + ids_of(name[4:], blocks=1)
    base = 1000 * (ord(name[0]) - ord("A") + 1)
    return [base + i for i in range(blocks * BLOCK + 7)]


def slot_bytes(ids: list[int]) -> bytes:
    """A slot file that starts with ``ids``, as the in-memory server writes it."""
    words = struct.pack("<iII", -1, slotfile.PACKED_VERSION, len(ids)) + slotfile.pack_ids(ids) + b"\0" * 4
    return struct.pack("<III", slotfile.MAGIC, slotfile.VERSION, len(words) // 4) + words + b"\x07" * 64


class TokenLlama(memllama.MemLlama):
    """The in-memory server, with slot files that start with the token ids each slot holds."""

    def __init__(self, slot_dir: Path) -> None:
        super().__init__(slot_dir)
        self.held: dict[int, list[int]] = {}
        self.tasks = itertools.count(1)

    def serve(self, slot_id: int, ids: list[int]) -> None:
        """A request on ``slot_id`` whose prompt is ``ids`` ran to its end."""
        self.held[slot_id] = ids
        self.run_turn(slot_id, task=next(self.tasks), tokens=len(ids))

    async def save(self, slot_id: int, filename: str) -> protocols.ActionResult:
        self.calls.append(("save", (slot_id, filename)))
        if "save" in self.hooks:
            await self.hooks["save"](slot_id, filename)
        ids = self.held.get(slot_id, [])
        data = slot_bytes(ids)
        (self.dir / filename).write_bytes(data)
        return protocols.ActionResult(slot_id, filename, len(ids), len(data), 1.0)

    async def restore(self, slot_id: int, filename: str) -> protocols.ActionResult:
        self.calls.append(("restore", (slot_id, filename)))
        if "restore" in self.hooks:
            await self.hooks["restore"](slot_id, filename)
        held = slotfile.read_tokens(self.dir / filename)
        self.held[slot_id] = list(struct.unpack(f"<{held.count}i", held.data))
        self.set_slot(slot_id, tokens=held.count)
        return protocols.ActionResult(slot_id, filename, held.count, (self.dir / filename).stat().st_size, 1.0)


OK = answer.Ended(200, outcomes.ProxyOutcome.OK, None)
"""An answer relayed to its end that gives no reuse figure: the planned source counts."""


class Tokenizer:
    """A conversation's ids are its first message's (``ids_of``); counts the round trips it stands for."""

    def __init__(self) -> None:
        self.asked = 0

    async def apply_template(self, body: dict[str, Any]) -> str:
        self.asked += 1
        return str(body["messages"][0]["content"])

    async def tokenize(self, text: str, *, owner: str = "") -> list[int]:
        return ids_of(text)


@dataclasses.dataclass
class Bed:
    server: TokenLlama
    snapshots: store.SnapshotStore
    registry: CollectorRegistry
    watcher: poller.Poller
    engine: engine.Engine
    library: placer.Placer
    clock: clocks.FakeClock
    tokenizer: Tokenizer
    stats: metrics.Metrics

    async def poll(self) -> None:
        obs, evts = await self.watcher.step()
        await self.engine.handle(obs, evts)

    @contextlib.asynccontextmanager
    async def request(
        self, conversation: str, ended: answer.Ended | None = None, *, then: tuple[str, ...] = (), **fields: Any
    ) -> AsyncIterator[int | None]:
        """A chat request of ``conversation`` (its first message, then the messages ``then``) through the placer;
        yields the slot it was pinned to."""
        self.clock.now += 1.0
        messages = [{"role": "user", "content": conversation}] + [{"role": "user", "content": t} for t in then]
        body = json.dumps({"messages": messages, **fields}).encode()
        async with self.library.pin("/v1/chat/completions", body) as forwarded:
            slot = json.loads(forwarded.body).get("id_slot")
            yield slot
            if slot is not None:
                self.server.serve(slot, ids_of(conversation))
            forwarded.answered(ended or OK)
        await self.poll()

    def value(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    def actions(self) -> list[tuple[str, int]]:
        return [(name, args[0]) for name, args in self.server.calls if name in ("save", "restore")]  # type: ignore[index]


@pytest.fixture
async def bed(tmp_path: Path) -> Bed:
    return await _bed(tmp_path)


async def _bed(tmp_path: Path, *, ram: ramtier.RamTier | None = None) -> Bed:
    """``ram``: the model of llama-server's RAM prompt cache the placer keeps."""
    server = TokenLlama(tmp_path)
    stamps = itertools.count(1_764_000_000)
    snapshots = store.SnapshotStore(tmp_path, clock=clocks.reading(lambda: float(next(stamps))))
    registry = CollectorRegistry()
    clock = clocks.FakeClock()
    settings = config.Settings(
        upstream=config.UpstreamSettings(),
        poll=config.PollSettings(),
        snapshots=config.SnapshotSettings(slot_dir=tmp_path, min_free_bytes=0, min_tokens=100),
        server=config.ServerSettings(),
    )
    stats = metrics.Metrics(registry, version="t")
    eng = engine.Engine(client=server, snapshots=snapshots, stats=stats, settings=settings, clock=clock)
    tokenizer = Tokenizer()
    library = placer.Placer(
        engine=eng.slots, tokenizer=tokenizer, snapshots=snapshots, stats=stats, clock=clock, ram=ram
    )
    watcher = poller.Poller(server, settings.poll, clock=clock)
    made = Bed(server, snapshots, registry, watcher, eng, library, clock, tokenizer, stats)
    await made.poll()
    return made


async def test_conversations_beyond_the_slots_are_saved_before_their_slot_is_given_away_and_swapped_back(
    bed: Bed,
) -> None:
    for name in ("A", "B"):
        async with bed.request(name) as slot:
            assert slot is not None
    assert bed.actions() == []  # two empty slots: nothing to save
    async with bed.request("C") as slot:
        assert slot == 0  # the least recently used
    assert bed.actions() == [("save", 0)]  # A saved before C took its slot
    async with bed.request("A") as slot:
        assert slot == 1  # B's slot, now the least recently used
    assert bed.actions() == [("save", 0), ("save", 1), ("restore", 1)]
    assert bed.server.held[1] == ids_of("A")
    async with bed.request("A") as slot:
        assert slot == 1  # already there
    assert bed.actions()[-1] == ("restore", 1)
    sources = {s: bed.value("llama_sidecar_conversation_requests_total", source=s) for s in ("slot", "library", "cold")}
    assert sources == {"slot": 1, "library": 1, "cold": 3}
    assert bed.value("llama_sidecar_library_tokens_total") == 3 * BLOCK
    assert bed.value("llama_sidecar_swap_duration_seconds_count") == 1
    assert len(bed.snapshots.library()) == 2  # A and B, kept side by side though both came from slot 0 and 1


async def test_a_slot_being_swapped_is_busy_and_its_conversation_waits_for_the_swap(bed: Bed) -> None:
    for name in ("A", "B", "C"):
        async with bed.request(name):
            pass
    release = asyncio.Event()
    restoring = asyncio.Event()

    async def held_restore(slot_id: int, filename: str) -> None:
        restoring.set()
        await release.wait()
        order.append(f"restored into {slot_id}")

    bed.server.hooks["restore"] = held_restore
    order: list[str] = []

    async def turn(name: str) -> int | None:
        async with bed.request(name) as slot:
            order.append(f"{name}:{slot}")
            return slot

    swap = asyncio.create_task(turn("A"))  # A is in the library only: swapped into slot 1 (B's)
    await restoring.wait()
    same = asyncio.create_task(turn("A"))  # the same conversation: held until the swap's request ends, then there
    bed.server.set_slot(0, processing=True)  # a request from elsewhere takes the other slot
    await bed.poll()
    other = asyncio.create_task(turn("D"))  # a new one: never the slot being swapped, so no slot now: held
    for _ in range(20):
        await asyncio.sleep(0)  # let both route while the restore is held
    assert order == [], "nothing placed, nothing sent unpinned while every slot is busy"
    release.set()
    assert await swap == 1
    assert await same == 1
    assert await other == 1  # slot 0 still runs the other client's request: slot 1, once A's requests ended
    assert order.index("restored into 1") < order.index("A:1")
    assert order == ["restored into 1", "A:1", "A:1", "D:1"]
    assert [a for a in bed.actions() if a[0] == "restore"] == [("restore", 1)]
    assert bed.actions()[-1] == ("save", 1), "A's turns saved before D took the slot"


async def test_with_every_slot_busy_a_request_is_held_then_placed_in_the_first_to_free_its_content_saved_first(
    bed: Bed,
) -> None:
    """Sent unpinned, llama-server would give it the first slot to free and run it over a turn no snapshot holds."""
    for name in ("A", "B"):
        async with bed.request(name):
            pass
    going = {name: asyncio.Event() for name in ("A", "B")}
    done = {name: asyncio.Event() for name in ("A", "B")}
    order: list[str] = []

    async def turn(name: str) -> int | None:
        async with bed.request(name, then=("and then?",)) as slot:
            order.append(f"{name}:{slot}")
            if name in going:
                assert slot is not None
                bed.server.set_slot(slot, processing=True)
                going[name].set()
                await done[name].wait()
            return slot

    runs = {name: asyncio.create_task(turn(name)) for name in ("A", "B")}
    await asyncio.gather(going["A"].wait(), going["B"].wait())
    saves = len(bed.actions())
    third = asyncio.create_task(turn("C"))
    for _ in range(20):
        await asyncio.sleep(0)
    assert not third.done(), "held while both slots run a request: not sent unpinned"
    done["B"].set()  # B's turn ends: its slot frees, with B's turn in no snapshot yet
    assert await runs["B"] == 1
    assert await third == 1
    assert bed.actions()[saves:] == [("save", 1)], "B's turn saved before C took its slot"
    assert order == ["A:0", "B:1", "C:1"]
    done["A"].set()
    assert await runs["A"] == 0


# ---- the shared store on the request path -----------------------------------------------


class FakeShared:
    """A shared store holding one conversation, snapshotted on another node (``seams.Shared``)."""

    def __init__(
        self, bed: Bed, tmp_path: Path, conversation: str, *, bandwidth: float = 1e9, ids: list[int] | None = None
    ) -> None:
        """``ids``: the snapshot's tokens, when not the whole of ``conversation``'s."""
        self.bed = bed
        self.bandwidth = bandwidth
        self.lookups = 0
        self.fetches = 0
        self.rates: list[float] = []
        self.lookup_wait: asyncio.Event | None = None
        self.fail_fetch = False
        self.fetching = asyncio.Event()
        """Set once a fetch has started."""
        ids = ids_of(conversation) if ids is None else ids
        other = store.SnapshotStore(tmp_path / "node-a", clock=clocks.reading(lambda: 1_700_000_000.0))
        other.dir.mkdir()
        temp = other.writer.temp_name(0)
        data = slot_bytes(ids)
        (other.dir / temp).write_bytes(data)
        _, identity = bed.engine.slots.seen()
        assert identity is not None
        fingerprint = manifest.Fingerprint.of(identity, n_ctx=self._n_ctx())
        made = other.writer.commit(temp, slot=0, tokens=len(ids), written=len(data), task=None, fingerprint=fingerprint)
        chain = slotfile.prefix_hashes(slotfile.pack_ids(ids))
        self.record = records.SharedRecord(made, "blobs/a", chain, BLOCK, 1_700_000_000.0)
        self.data = data

    def _n_ctx(self) -> int:
        obs, _ = self.bed.engine.slots.seen()
        assert obs is not None
        assert obs.slots is not None
        return obs.slots[0].n_ctx

    async def lookup(
        self, identity: events.Identity, chain: tuple[str, ...], *, max_tokens: int, owner: str
    ) -> catalog.Match | None:
        self.lookups += 1
        if self.lookup_wait is not None:
            await self.lookup_wait.wait()
        return catalog.best_match([self.record], chain, max_tokens=max_tokens, block_tokens=BLOCK)

    async def worth(self, match: catalog.Match, *, cached_tokens: int, prefill_rate: float) -> decide.Estimate:
        self.rates.append(prefill_rate)
        return decide.fetch_or_prefill(
            size=match.record.snapshot.bytes,
            saved_tokens=match.tokens - cached_tokens,
            bandwidth=self.bandwidth,
            prefill_rate=prefill_rate,
            overhead=0.0,
        )

    async def fetch(self, shared: records.SharedRecord, *, slot: int) -> manifest.Manifest | None:
        self.fetches += 1
        self.fetching.set()
        await asyncio.sleep(0)  # a transfer: the loop runs other work meanwhile
        if self.fail_fetch:
            return None  # the real store counts and logs its own failures
        snapshots = self.bed.snapshots
        temp = snapshots.writer.temp_name(slot)
        (snapshots.dir / temp).write_bytes(self.data)
        return snapshots.writer.commit(
            temp,
            slot=slot,
            tokens=shared.snapshot.tokens,
            written=len(self.data),
            task=None,
            fingerprint=shared.snapshot.fingerprint,
        )


def with_shared(bed: Bed, shared: FakeShared) -> None:
    bed.library = placer.Placer(
        engine=bed.engine.slots,
        tokenizer=Tokenizer(),
        snapshots=bed.snapshots,
        stats=bed.stats,
        clock=bed.clock,
        shared=shared,
        hold_seconds=5.0,
    )


async def test_a_conversation_only_the_shared_store_holds_is_fetched_into_an_idle_slot_and_swapped_in(
    bed: Bed, tmp_path: Path
) -> None:
    shared = FakeShared(bed, tmp_path, "A")
    with_shared(bed, shared)
    async with bed.request("B"):
        pass  # slot 0 now holds B, unsaved
    async with bed.request("A") as slot:
        assert slot == 1  # the empty slot
    assert bed.server.held[1] == ids_of("A")
    assert bed.actions() == [("restore", 1)]
    assert (shared.lookups, shared.fetches) == (2, 1)  # B found nothing there
    assert shared.rates == [decide.DEFAULT_PREFILL_RATE]  # the server has not measured enough yet
    assert bed.value("llama_sidecar_conversation_requests_total", source="shared") == 1
    assert bed.value("llama_sidecar_library_tokens_total") == 3 * BLOCK
    async with bed.request("A") as slot:
        assert slot == 1
    assert shared.lookups == 2  # the slot holds the whole prompt: no need to ask
    async with bed.request("A") as slot:
        pass
    assert bed.value("llama_sidecar_conversation_requests_total", source="slot") == 2


@pytest.mark.parametrize("kind", [events.Memory.SWA, events.Memory.HYBRID])
async def test_on_a_model_that_cannot_cut_back_only_a_shared_snapshot_the_request_holds_whole_is_fetched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: events.Memory
) -> None:
    """Another conversation's snapshot that shares the request's first blocks was fetched and restored for
    nothing on a windowed model (the soak: llama-server re-prefilled every token, ``restore_ineffective``)."""
    monkeypatch.setattr(memory, "of_file", lambda path: kind)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    bed = await _bed(tmp_path / "a")
    ids = ids_of("A")
    other = FakeShared(bed, tmp_path / "a", "A", ids=ids[: 2 * BLOCK] + [7] * (BLOCK + 7))
    with_shared(bed, other)
    async with bed.request("A") as slot:
        assert slot is not None
    assert (other.lookups, other.fetches) == (1, 0), "another conversation's snapshot is not fetched"
    assert bed.actions() == []
    assert bed.value("llama_sidecar_conversation_requests_total", source="cold") == 1

    bed = await _bed(tmp_path / "b")
    own = FakeShared(bed, tmp_path / "b", "A", ids=ids[:-3])
    with_shared(bed, own)
    async with bed.request("A") as slot:
        assert slot is not None
    assert own.fetches == 1, "a snapshot whose every token the request holds is fetched"
    assert bed.actions() == [("restore", slot)]


async def test_the_shared_snapshot_replaces_a_changed_slot_only_after_saving_it(bed: Bed, tmp_path: Path) -> None:
    shared = FakeShared(bed, tmp_path, "A")
    with_shared(bed, shared)
    for name in ("B", "C"):
        async with bed.request(name):
            pass
    async with bed.request("A") as slot:
        assert slot == 0  # B's slot, the least recently used
    assert bed.actions() == [("save", 0), ("restore", 0)]
    assert bed.server.held[0] == ids_of("A")


async def test_the_fetch_runs_while_the_slot_is_saved_and_what_it_committed_is_not_hashed_again(
    bed: Bed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = FakeShared(bed, tmp_path, "A")
    with_shared(bed, shared)
    for name in ("B", "C"):
        async with bed.request(name):
            pass

    async def save_waits_for_the_fetch(slot_id: int, filename: str) -> None:
        await asyncio.wait_for(shared.fetching.wait(), timeout=2)  # in turn, the fetch would start after the save

    bed.server.hooks["save"] = save_waits_for_the_fetch
    hashed: list[str] = []
    check = bed.snapshots.curator.check

    def counted(record: manifest.Manifest) -> None:
        hashed.append(record.file)
        check(record)

    monkeypatch.setattr(bed.snapshots.curator, "check", counted)
    async with bed.request("A") as slot:
        assert slot == 0
    assert bed.actions() == [("save", 0), ("restore", 0)]
    assert bed.server.held[0] == ids_of("A")
    assert hashed == []  # hashed as it was fetched and committed: the swap restores it as it is


async def test_a_fetch_slower_than_the_prefill_it_saves_is_not_made(bed: Bed, tmp_path: Path) -> None:
    shared = FakeShared(bed, tmp_path, "A", bandwidth=1.0)
    with_shared(bed, shared)
    bed.server.prompt_tokens, bed.server.prompt_seconds = 4000.0, 8.0  # measured: 500 tokens/s
    await bed.poll()
    async with bed.request("A") as slot:
        assert slot == 0
    assert shared.rates == [500.0]
    assert (shared.lookups, shared.fetches) == (1, 0)
    assert bed.actions() == []
    assert bed.value("llama_sidecar_conversation_requests_total", source="cold") == 1


async def test_a_slow_store_costs_the_request_the_lookup_bound_then_it_runs_cold(
    bed: Bed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fetching, "LOOKUP_SECONDS", 0.05)
    shared = FakeShared(bed, tmp_path, "A")
    shared.lookup_wait = asyncio.Event()  # never answers
    with_shared(bed, shared)
    async with bed.request("A") as slot:
        assert slot == 0
    assert bed.value("llama_sidecar_shared_store_errors_total", operation="list") == 1
    assert bed.value("llama_sidecar_conversation_requests_total", source="cold") == 1
    assert bed.actions() == []


async def test_a_failed_fetch_runs_the_request_cold_in_the_slot_it_saved(bed: Bed, tmp_path: Path) -> None:
    shared = FakeShared(bed, tmp_path, "A")
    shared.fail_fetch = True
    with_shared(bed, shared)
    for name in ("B", "C"):
        async with bed.request(name):
            pass
    async with bed.request("A") as slot:
        assert slot == 0
    assert shared.fetches == 1
    assert bed.actions() == [("save", 0)]  # B is kept; nothing restored
    assert bed.value("llama_sidecar_conversation_requests_total", source="cold") == 3
    assert bed.value("llama_sidecar_conversation_requests_total", source="shared") == 0
    assert bed.value("llama_sidecar_conversation_unrouted_total", reason="swap") == 0


async def test_a_store_that_breaks_unexpectedly_never_fails_the_request(bed: Bed, tmp_path: Path) -> None:
    shared = FakeShared(bed, tmp_path, "A")

    async def broken(
        identity: events.Identity, chain: tuple[str, ...], *, max_tokens: int, owner: str
    ) -> catalog.Match | None:
        raise RuntimeError("boom")

    shared.lookup = broken  # type: ignore[method-assign]
    with_shared(bed, shared)
    async with bed.request("A") as slot:
        assert slot is None  # forwarded as it came
    assert bed.value("llama_sidecar_conversation_unrouted_total", reason="error") == 1


async def test_a_slot_filled_since_the_last_poll_is_saved_before_it_is_given_away(bed: Bed) -> None:
    async def unpolled(conversation: str) -> int:
        """A request that ends before the next poll: the poll's view still shows its slot as it was."""
        bed.clock.now += 1.0
        body = json.dumps({"messages": [{"role": "user", "content": conversation}]}).encode()
        async with bed.library.pin("/v1/chat/completions", body) as forwarded:
            slot: int = json.loads(forwarded.body)["id_slot"]
            bed.server.serve(slot, ids_of(conversation))
            forwarded.answered(OK)
        return slot

    first = await unpolled("A")
    assert await unpolled("B") != first
    assert bed.actions() == []
    assert await unpolled("C") == first  # the least recently used: the poll still shows it empty
    assert bed.actions() == [("save", first)]  # A saved before C took its slot, read afresh
    assert [m.slot for m in bed.snapshots.library()] == [first]


# ---- turns the placer did not route (straight to llama-server, or unrouted) -------------------


async def saved_both(bed: Bed) -> None:
    """Both slots idle long enough: the engine saves them (their content is then settled)."""
    bed.clock.now += 10.0
    await bed.poll()
    await bed.engine.work()
    assert sorted(bed.actions()) == [("save", 0), ("save", 1)]
    bed.server.calls.clear()


async def test_a_turn_that_ended_after_the_last_poll_is_saved_before_its_slot_is_given_away(bed: Bed) -> None:
    for name in ("A", "B"):
        async with bed.request(name):
            pass
    await saved_both(bed)
    bed.server.serve(0, ids_of("D"))  # straight to llama-server, between two polls
    async with bed.request("C") as slot:
        assert slot == 0  # the least recently used: it holds D now, which no snapshot has
    assert bed.actions() == [("save", 0)]
    newest = next(iter(bed.snapshots.snapshots(0)))
    assert newest.index is not None
    assert newest.index.chain == slotfile.prefix_hashes(slotfile.pack_ids(ids_of("D")))


async def test_a_conversation_whose_slot_another_client_took_is_swapped_back_not_run_over_it(bed: Bed) -> None:
    for name in ("A", "B"):
        async with bed.request(name):
            pass
    await saved_both(bed)
    bed.server.serve(0, ids_of("D"))  # another client's turn replaced A in slot 0, unseen by any poll
    async with bed.request("A") as slot:
        assert slot == 0
    assert bed.actions() == [("save", 0), ("restore", 0)]  # D saved first, then A put back
    assert bed.server.held[0] == ids_of("A")
    assert bed.value("llama_sidecar_conversation_requests_total", source="slot") == 0


async def test_a_server_that_measured_nothing_yet_takes_the_prefill_rate_the_shared_snapshot_records(
    bed: Bed, tmp_path: Path
) -> None:
    shared = FakeShared(bed, tmp_path, "A")
    shared.record = dataclasses.replace(
        shared.record, snapshot=dataclasses.replace(shared.record.snapshot, prefill_rate=400.0)
    )
    with_shared(bed, shared)
    async with bed.request("A") as slot:
        assert slot is not None
    assert shared.rates == [400.0]
    assert bed.value("llama_sidecar_conversation_requests_total", source="shared") == 1


def _sources(bed: Bed) -> dict[str, float]:
    return {s: bed.value("llama_sidecar_conversation_requests_total", source=s) for s in ("slot", "library", "cold")}


async def test_each_request_counts_by_its_own_answer_not_by_where_it_was_placed(bed: Bed) -> None:
    for name in ("A", "B", "C"):
        async with bed.request(name):
            pass
    reprefilled = answer.Ended(200, outcomes.ProxyOutcome.OK, 0)  # the server reused nothing of the swap
    async with bed.request("A", reprefilled) as slot:
        assert slot == 1
    assert bed.actions()[-1] == ("restore", 1)
    assert _sources(bed) == {"slot": 0, "library": 0, "cold": 4}
    assert bed.value("llama_sidecar_library_tokens_total") == 0
    assert bed.value("llama_sidecar_restore_verifications_total", outcome="ineffective") == 1
    reused = answer.Ended(200, outcomes.ProxyOutcome.OK, 3 * BLOCK)
    async with bed.request("B", reused) as slot:
        assert slot == 0
    assert _sources(bed)["library"] == 1
    assert bed.value("llama_sidecar_library_tokens_total") == 3 * BLOCK
    assert bed.value("llama_sidecar_restore_verifications_total", outcome="effective") == 1


async def test_each_routed_request_leaves_one_info_line_with_where_it_ran_and_what_it_reused_and_no_prompt(
    bed: Bed,
) -> None:
    for name in ("A", "B", "C"):
        async with bed.request(name):
            pass
    with structlog.testing.capture_logs() as logs:
        async with bed.request("A", answer.Ended(200, outcomes.ProxyOutcome.OK, 3 * BLOCK)) as slot:
            assert slot == 1
    lines = [line for line in logs if line["event"] == "request_answered"]
    assert len(lines) == 1, logs
    line = lines[0]
    assert line["log_level"] == "info"
    assert (line["planned"], line["planned_slot"], line["slot"], line["source"]) == ("library", 1, 1, "library")
    assert line["restored_tokens"] >= 3 * BLOCK, line
    assert (line["reused_tokens"], line["status"]) == (3 * BLOCK, 200)
    assert line["unserved"] is None
    assert not any(str(v) == "A" or isinstance(v, list) for v in line.values()), "no prompt text or token ids"


@pytest.mark.parametrize(
    ("ended", "reason"),
    [
        (answer.Ended(400, outcomes.ProxyOutcome.OK, None), "rejected"),
        (answer.Ended(200, outcomes.ProxyOutcome.ERROR, None), "cut"),
        (answer.Ended(200, outcomes.ProxyOutcome.CANCELLED, None), "cancelled"),
    ],
)
async def test_a_rejected_or_cut_request_is_no_serve(bed: Bed, ended: answer.Ended, reason: str) -> None:
    async with bed.request("A", ended) as slot:
        assert slot == 0
    assert _sources(bed) == {"slot": 0, "library": 0, "cold": 0}
    assert bed.value("llama_sidecar_conversation_unserved_total", reason=reason) == 1
    async with bed.request("A"):
        pass
    assert _sources(bed) == {"slot": 0, "library": 0, "cold": 1}, "nothing is known to hold A after such an answer"


async def test_an_anthropic_request_is_placed_without_id_slot_and_a_new_one_saves_every_changed_idle_slot(
    bed: Bed,
) -> None:
    for name in ("A", "B"):
        async with bed.request(name):
            pass
    body = json.dumps({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "C"}]}).encode()
    async with bed.library.pin("/v1/messages", body) as placed:
        assert placed.body == body, "the Anthropic converter drops id_slot: the body goes as it came"
        assert placed.header.startswith("source=cold; slot=0;")
        bed.server.serve(1, ids_of("C"))  # the server may pick another idle slot than the placer's
        placed.answered(OK)
    assert sorted(bed.actions()) == [("save", 0), ("save", 1)], "whichever slot the server takes, nothing is lost"
    await bed.poll()
    async with bed.library.pin("/v1/messages", body) as placed:
        assert placed.header.startswith("source=slot; slot=1;"), "the slot the server ran it in was read back"
        placed.answered(OK)
    async with bed.request("A") as slot:
        assert slot is not None
    assert bed.server.held[slot] == ids_of("A"), "A came back from the library"


async def test_a_next_turn_goes_to_the_slot_that_ran_its_conversation_with_no_template_or_tokenize(bed: Bed) -> None:
    async with bed.request("A") as first:
        assert first is not None
    async with bed.request("B") as other:
        assert other not in (None, first)
    assert bed.tokenizer.asked == 2
    async with bed.request("A", then=("ok", "and then?"), stream=True, max_tokens=9) as slot:
        assert slot == first  # sampling fields are no part of the prompt
    async with bed.request("A", then=("ok", "and then?", "ok", "more")) as slot:
        assert slot == first
    assert bed.tokenizer.asked == 2  # no round trip for either next turn
    routes = {by: bed.value("llama_sidecar_library_routes_total", by=by) for by in ("turn", "tokens")}
    assert routes == {"turn": 2, "tokens": 2}
    assert bed.value("llama_sidecar_conversation_requests_total", source="slot") == 2


async def test_a_next_turns_slots_read_goes_out_before_its_body_is_parsed_and_is_the_only_one(
    bed: Bed, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with bed.request("A") as first:
        assert first is not None
    seen: list[str] = []
    read, of = bed.engine.slots.fresh_slots, turns.of

    async def fresh_slots() -> tuple[events.SlotView, ...]:
        seen.append("read")
        return await read()

    def parsed(request: prompt.Prompt) -> turns.Key | None:
        seen.append("parsed")
        return of(request)

    monkeypatch.setattr(bed.engine.slots, "fresh_slots", fresh_slots)
    monkeypatch.setattr(turns, "of", parsed)
    async with bed.request("A", then=("ok", LONG)) as slot:
        assert slot == first
        assert seen == ["read", "parsed"]  # llama-server answers while the messages are hashed; no second read
    assert bed.value("llama_sidecar_library_routes_total", by="turn") == 1
    seen.clear()
    async with bed.request("C", then=(LONG,)) as other:  # no slot ran C: the early read is left unread
        assert other not in (None, first)
        assert seen == ["read", "parsed", "read"]  # placed on a read made after its tokens


async def _back_from_ram(bed: Bed, monkeypatch: pytest.MonkeyPatch) -> tuple[int | None, list[str]]:
    """A and B run in the two slots, C takes A's (the server copies A into its RAM cache), then A's next turn
    comes: (the slot it went to, what was asked of the server for it)."""
    for name in ("A", "B", "C"):
        async with bed.request(name) as slot:
            assert slot is not None
    asked: list[str] = []
    read = bed.engine.slots.fresh_slots

    async def fresh_slots() -> tuple[events.SlotView, ...]:
        asked.append("slots")
        return await read()

    async def saved(slot: int, filename: str) -> None:
        asked.append("save")

    monkeypatch.setattr(bed.engine.slots, "fresh_slots", fresh_slots)
    monkeypatch.setitem(bed.server.hooks, "save", saved)
    tokenized = bed.tokenizer.asked
    async with bed.request("A", then=("ok", LONG)) as slot:
        pass
    asked += ["tokenize"] * (bed.tokenizer.asked - tokenized)
    return slot, asked


async def test_a_turn_back_from_the_ram_cache_is_placed_on_the_slots_read_sent_as_it_came_and_no_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bed = await _bed(tmp_path, ram=ramtier.RamTier(1 << 30))
    slot, asked = await _back_from_ram(bed, monkeypatch)
    assert slot is not None
    # The read sent as it came places it (nothing was asked of the server since), the slot it takes is saved
    # before it is given away, and the last read is the one made once the request ended.
    assert asked == ["slots", "save", "slots"]
    assert bed.value("llama_sidecar_library_routes_total", by="ram_turn") == 1


@pytest.mark.parametrize("kind", [events.Memory.HYBRID, events.Memory.RECURRENT])
async def test_a_model_that_cannot_cut_its_state_back_places_a_turn_back_from_ram_by_its_ids(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: events.Memory
) -> None:
    """There a restored state serves only a request holding all its tokens: the copy's chain cannot say that."""
    monkeypatch.setattr(memory, "of_file", lambda path: kind)  # as read from the model file's GGUF header
    bed = await _bed(tmp_path, ram=ramtier.RamTier(1 << 30))
    slot, asked = await _back_from_ram(bed, monkeypatch)
    assert slot is not None
    assert "tokenize" in asked
    assert bed.value("llama_sidecar_library_routes_total", by="ram_turn") == 0
    assert bed.value("llama_sidecar_library_routes_total", by="tokens") == 4


@pytest.mark.parametrize(
    ("then", "fields"),
    [
        pytest.param(("edited", "more"), {}, id="an earlier message edited"),
        pytest.param(("ok",), {"tools": [{"type": "function", "function": {"name": "f"}}]}, id="tools given"),
        pytest.param((), {}, id="history cut back"),
    ],
)
async def test_a_request_that_does_not_continue_the_slots_last_turn_is_routed_by_its_ids(
    bed: Bed, then: tuple[str, ...], fields: dict[str, Any]
) -> None:
    async with bed.request("A", then=("ok", "first")):
        pass
    asked = bed.tokenizer.asked
    async with bed.request("A", then=then, **fields) as slot:
        assert slot is not None
    assert bed.tokenizer.asked == asked + 1
    assert bed.value("llama_sidecar_library_routes_total", by="turn") == 0


@pytest.mark.parametrize("then", [pytest.param("next", id="short body"), pytest.param(LONG, id="read sent early")])
async def test_a_slot_another_client_ran_a_turn_in_since_is_no_next_turn_and_its_turn_is_saved(
    bed: Bed, then: str
) -> None:
    async with bed.request("A") as slot:
        assert slot is not None
    async with bed.request("B"):
        pass
    bed.server.serve(slot, ids_of("Z"))  # straight to llama-server, after the last poll
    async with bed.request("A", then=("ok", then)) as again:
        assert again is not None
    assert bed.tokenizer.asked == 3  # the fresh /slots read showed the other turn: routed by ids
    assert bed.value("llama_sidecar_library_routes_total", by="turn") == 0
    assert again == slot  # the least recently used: Z's turn is saved before A runs over it
    assert bed.actions()[-1] == ("save", slot)


async def test_only_a_routed_request_asks_for_its_answers_reuse_figure_and_one_naming_its_slot_is_counted_unrouted(
    bed: Bed,
) -> None:
    routed = json.dumps({"messages": [{"role": "user", "content": "A"}]}).encode()
    async with bed.library.pin("/v1/chat/completions", routed) as placed:
        assert placed.counted, "its answer's reuse figure judges where it was placed"
        placed.answered(OK)
    own = json.dumps({"prompt": "x" * 200, "id_slot": 1}).encode()
    for _ in range(2):
        async with bed.library.pin("/completion", own) as placed:
            assert (placed.body, placed.counted) == (own, False), "forwarded as it came; its answer is not read"
            assert placed.header == "source=unrouted; reason=own_slot"
    assert bed.value("llama_sidecar_conversation_unrouted_total", reason="own_slot") == 2


async def test_a_slot_counts_busy_while_a_live_ticket_holds_it_and_is_free_once_the_gate_closed_on_that_ticket(
    bed: Bed,
) -> None:
    """The placer's count of routed requests on a slot is its live tickets that hold the slot, nothing kept apart."""
    for name in ("A", "B"):
        async with bed.request(name):
            pass
    ticket = tickets.Ticket()
    ticket.let_through(None)
    body = json.dumps({"messages": [{"role": "user", "content": "A"}]}).encode()
    async with bed.library.pin("/v1/chat/completions", body, ticket=ticket) as placed:
        assert (json.loads(placed.body)["id_slot"], ticket.slot) == (0, 0)  # used as late as slot 1 now
        async with bed.request("C") as other:
            assert other == 1, "slot 0 (the lower of two used as late) is busy: a live request holds it"
        ticket.place()
        ticket.send()
        assert ticket.closed() is tickets.Resume.REPLACE  # a crash before the answer: it holds no slot now
        assert ticket.slot is None
        async with bed.request("D") as third:
            assert third == 0, "the least recently used slot, free again: nothing else counts it busy"
        placed.answered(answer.Ended(0, outcomes.ProxyOutcome.CANCELLED, None))


async def test_a_swap_whose_restore_fails_runs_its_request_cold_in_the_slot_it_saved_never_unpinned(bed: Bed) -> None:
    """The slot's own content was saved before the restore was refused: the request runs cold there. It used to
    go as it came, and llama-server gave it the idle slot of its choice: in the soak, another conversation's
    newest turn, not saved yet, was lost that way."""
    for name in ("A", "B", "C"):  # A goes to the library, B is in a slot and in no snapshot, C in the other
        async with bed.request(name):
            pass

    async def refused(slot_id: int, filename: str) -> None:
        raise errors.UpstreamRejected("the file is refused", endpoint="/slots", status=400)

    bed.server.hooks["restore"] = refused
    ticket = tickets.Ticket()
    ticket.let_through(None)
    cold = bed.value("llama_sidecar_conversation_requests_total", source="cold")
    body = json.dumps({"messages": [{"role": "user", "content": "A"}]}).encode()
    async with bed.library.pin("/v1/chat/completions", body, ticket=ticket) as placed:
        slot = json.loads(placed.body).get("id_slot")
        assert slot == 1, "pinned to the slot whose content was saved (B's), not sent as it came"
        assert ticket.slot == 1
        placed.answered(OK)
    assert bed.actions()[-2:] == [("save", 1), ("restore", 1)]
    assert bed.value("llama_sidecar_conversation_unrouted_total", reason="swap") == 0
    assert bed.value("llama_sidecar_conversation_requests_total", source="cold") == cold + 1


async def test_a_slot_taken_between_its_read_and_its_save_sends_the_request_elsewhere_not_unpinned(
    bed: Bed, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request llama-server had queued may start in the slot the placer chose before its content is saved: the
    save is skipped as busy, and the request is placed again (another slot, or held), never sent unpinned."""
    for name in ("A", "B"):  # A in slot 0, the least recently used; both in no snapshot
        async with bed.request(name):
            pass
    real = bed.engine.slots.save
    taken: list[int] = []

    async def taken_first(action: Any) -> bool:
        if not taken:
            taken.append(action.slot)
            bed.server.set_slot(action.slot, processing=True)  # a queued request started there
            return False  # as the engine answers a save of a busy slot
        return await real(action)

    monkeypatch.setattr(bed.engine.slots, "save", taken_first)
    async with bed.request("C") as slot:
        assert slot == 1, "placed again, in the slot still idle (B's, saved first)"
    assert taken == [0]
    assert bed.actions() == [("save", 1)]
    assert bed.value("llama_sidecar_conversation_unrouted_total", reason="swap") == 0


async def test_requests_that_chose_a_slot_while_the_shared_store_answered_do_not_both_take_it(
    bed: Bed, tmp_path: Path
) -> None:
    """Each request chooses its slot, then asks the shared store (up to its lookup bound): a slot another request
    took meanwhile is taken no more. Pinned there anyway, llama-server would queue it behind that request and run
    it over the turn it leaves, which no snapshot holds yet."""
    shared = FakeShared(bed, tmp_path, "A")
    shared.lookup_wait = asyncio.Event()
    with_shared(bed, shared)
    inside = {name: asyncio.Event() for name in ("B", "C")}
    leave = asyncio.Event()
    slots: dict[str, int | None] = {}

    async def turn(name: str) -> None:
        async with bed.request(name) as slot:
            slots[name] = slot
            inside[name].set()
            await leave.wait()

    runs = [asyncio.create_task(turn(name)) for name in ("B", "C")]
    for _ in range(200):
        if shared.lookups == 2:
            break
        await asyncio.sleep(0)
    assert shared.lookups == 2, "both chose a slot, and wait for the store"
    shared.lookup_wait.set()
    await asyncio.wait_for(asyncio.gather(inside["B"].wait(), inside["C"].wait()), timeout=2)
    assert sorted(s for s in slots.values() if s is not None) == [0, 1], f"one request per slot, got {slots}"
    leave.set()
    await asyncio.gather(*runs)


async def test_a_conversation_whose_slot_is_being_saved_for_a_swap_waits_for_that_save_not_an_older_snapshot(
    bed: Bed,
) -> None:
    """A swap saves the slot's conversation first; a request of that conversation that comes meanwhile waits for
    the save and is swapped in from it, not placed from an older snapshot (or cold) beside it."""
    for name in ("A", "B", "C"):  # A in slot 0, B in slot 1, then C in slot 0 (A saved first)
        async with bed.request(name):
            pass
    saving = asyncio.Event()
    release = asyncio.Event()

    async def held_save(slot_id: int, filename: str) -> None:
        if slot_id == 1 and not saving.is_set():
            saving.set()
            await release.wait()

    bed.server.hooks["save"] = held_save
    slots: dict[str, int | None] = {}

    async def turn(name: str) -> None:
        async with bed.request(name, then=("and then?",)) as slot:
            slots[name] = slot

    back = asyncio.create_task(turn("A"))  # A swaps into slot 1, the least recently used: B is saved first
    await asyncio.wait_for(saving.wait(), timeout=2)
    leaving = asyncio.create_task(turn("B"))
    for _ in range(50):
        await asyncio.sleep(0)
    assert not leaving.done(), "B waits for its own save, under way"
    release.set()
    await asyncio.wait_for(asyncio.gather(back, leaving), timeout=5)
    assert slots == {"A": 1, "B": 0}
    assert bed.actions()[-2:] == [("save", 0), ("restore", 0)], "B came back from the save made as it left"
    assert bed.value("llama_sidecar_conversation_requests_total", source="cold") == 3  # A, B and C's first turns


async def test_a_turn_that_ends_elsewhere_while_a_request_the_server_places_is_saved_for_is_saved_too(
    bed: Bed,
) -> None:
    """Soak finding: an Anthropic request (llama-server picks its slot) saved the idle slot it was placed in; a
    routed turn ended on the other slot meanwhile, and the server gave the request that slot, over the turn."""
    for name in ("A", "B"):  # A in slot 0, B in slot 1
        async with bed.request(name):
            pass
    await _a_turn_ends_on_slot_0_during_slot_1s_save(bed, "A", ids_of("A", blocks=4), "C", "source=cold; slot=1;")


async def _a_turn_ends_on_slot_0_during_slot_1s_save(bed: Bed, a: str, longer: list[int], c: str, header: str) -> None:
    """A's next turn (``longer``) runs on slot 0 as an Anthropic request ``c`` comes, is placed by ``header`` and
    saves slot 1 first; A's turn ends during that save: slot 0 is saved too, before ``c`` is sent."""

    async def a_turn_ends_on_slot_0(slot_id: int, filename: str) -> None:
        if slot_id == 1 and bed.server.slot_views[0].processing:
            bed.server.serve(0, longer)  # ended on the server; its answer is still relayed (its ticket is live)

    body = json.dumps({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": c}]}).encode()
    async with bed.request(a, then=("and then?",)) as slot:
        assert slot == 0
        bed.server.set_slot(0, processing=True)
        await bed.poll()
        bed.server.hooks["save"] = a_turn_ends_on_slot_0
        async with bed.library.pin("/v1/messages", body) as placed:
            assert placed.header.startswith(header), placed.header
            assert bed.actions() == [("save", 1), ("save", 0)], "slot 0 went idle during slot 1's save: saved too"
            placed.answered(OK)
    newest = bed.snapshots.snapshots(0)[0]
    assert newest.tokens == len(longer), "the snapshot holds A's newest turn"


async def _a_and_b_share_the_system_prompt_in_slots_0_and_1(bed: Bed) -> None:
    async with bed.request("sys:A") as slot:  # A in slot 0
        assert slot == 0
        bed.server.set_slot(0, processing=True)  # A's turn runs: B goes to the empty slot
        await bed.poll()
        async with bed.request("sys:B") as other:
            assert other == 1


async def test_a_request_the_server_places_that_shares_only_the_system_prompt_saves_every_idle_slot_first(
    bed: Bed,
) -> None:
    """Soak finding: a new Anthropic conversation shares only the system prompt with both slots' conversations.
    The placer put it in slot 1, saved slot 1 (its content is cut), and sent it; llama-server, whose slots tie on
    the common prefix, gave it slot 0, over a turn that had just ended there, in no snapshot."""
    await _a_and_b_share_the_system_prompt_in_slots_0_and_1(bed)
    assert bed.actions() == []
    body = json.dumps({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "sys:C"}]}).encode()
    async with bed.library.pin("/v1/messages", body) as placed:
        assert placed.header.startswith("source=slot;"), placed.header
        assert sorted(bed.actions()) == [("save", 0), ("save", 1)], "whichever slot the server takes, it is saved"
        bed.server.serve(0, ids_of("sys:C"))
        placed.answered(OK)
    assert {r.tokens for s in (0, 1) for r in bed.snapshots.snapshots(s)} == {len(ids_of("sys:A"))}


async def test_a_request_the_server_places_saves_a_slot_that_was_busy_when_routed_once_its_turn_ended(
    bed: Bed,
) -> None:
    """Soak finding (60 minutes, seed 7, at 790 s): a new Anthropic conversation shares only the system prompt with
    both slots. Routed while slot 0's turn still ran, it was placed in slot 1, whose save came first; slot 0's turn
    ended meanwhile, and the busy slot had not counted as one the server could give the request: it was sent at
    once, and the server gave it slot 0, over that turn, in no snapshot."""
    await _a_and_b_share_the_system_prompt_in_slots_0_and_1(bed)
    longer = SYSTEM + ids_of("A", blocks=2)
    await _a_turn_ends_on_slot_0_during_slot_1s_save(bed, "sys:A", longer, "sys:C", "source=slot; slot=1;")


async def test_a_slot_rewound_to_its_prompts_boundary_before_a_save_still_holds_its_conversation(bed: Bed) -> None:
    """Soak finding: the engine's rewind before a save (sliding-window and hybrid models) runs a request on the
    slot. Read before the save committed, the slot's new content read as another client's turn: the placer forgot
    what it held, and the conversation's next turn went to an older snapshot of it, losing its newest turn."""
    for name in ("A", "B"):
        async with bed.request(name):
            pass
    await bed.library._book.fresh(bed.engine.slots.seen()[0])  # type: ignore[arg-type]  # the read after a turn
    before = bed.server.slot_views[0].signature
    assert before is not None
    bed.server.set_slot(0, task=before.task + 50, tokens=before.tokens - 3)  # the rewind's own request ran there
    after = bed.server.slot_views[0].signature
    assert after is not None
    bed.library.rewound(0, before, after)
    body = json.dumps({"messages": [{"role": "user", "content": "A"}, {"role": "user", "content": "on"}]}).encode()
    async with bed.library.pin("/v1/chat/completions", body) as placed:
        assert placed.header.startswith("source=slot; slot=0;"), placed.header
        placed.answered(OK)


async def test_a_request_the_server_places_is_recorded_in_its_own_slot_when_another_slots_turn_ends_after_it(
    bed: Bed,
) -> None:
    """Soak finding: an Anthropic turn ended in the slot it was placed in as another slot's turn ended with a newer
    task; read back as the newest task, the turn was recorded in the other slot, and the conversation's next turn
    was swapped in from an older snapshot over its own newest turn."""
    for name in ("B", "C"):  # B in slot 0, C in slot 1
        async with bed.request(name):
            pass
    body = json.dumps({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "A"}]}).encode()
    async with bed.library.pin("/v1/messages", body) as placed:
        assert placed.header.startswith("source=cold; slot=0;")
        bed.server.serve(0, ids_of("A"))  # it ran where it was placed
        bed.server.serve(1, ids_of("C"))  # a turn sent straight to llama-server ended on slot 1 after it
        placed.answered(OK)
    await bed.poll()
    async with bed.library.pin("/v1/messages", body) as placed:
        assert placed.header.startswith("source=slot; slot=0;"), placed.header
        placed.answered(OK)


async def test_a_request_the_server_places_is_recorded_in_the_slot_it_ran_in_when_that_slot_is_busy_again(
    bed: Bed,
) -> None:
    """Soak finding: an Anthropic turn placed in slot 1 ran in slot 0, and a request llama-server had queued for
    slot 0 started there as it ended. Read back, slot 0 was busy and slot 1 had run nothing since: the turn was
    recorded in slot 1, where it never ran, as if it held that conversation."""
    for name in ("B", "C"):  # B in slot 0, C in slot 1
        async with bed.request(name):
            pass
    states = bed.library._book.states  # what the placer records each slot holds
    b_chain, c_chain = states[0].chain, states[1].chain
    body = json.dumps({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "A"}]}).encode()
    async with bed.library.pin("/v1/messages", body) as placed:
        assert placed.header.startswith("source=cold; slot=0;")
        bed.server.serve(1, ids_of("A"))  # the server gave it slot 1
        bed.server.set_slot(1, processing=True, task=next(bed.server.tasks))  # the next request started there
        placed.answered(OK)
    assert states[1].chain not in ((), b_chain, c_chain), "slot 1, where it ran, holds A"
    assert states[0].chain != states[1].chain, "slot 0, where it was placed but never ran, does not hold A"


async def test_a_request_the_server_places_keeps_the_other_idle_slots_from_other_requests_until_it_started(
    bed: Bed,
) -> None:
    """Soak finding: an Anthropic turn placed in slot 1 was given slot 0 by llama-server; a request the library
    had pinned to slot 0 meanwhile was queued there by the server and started the moment the turn ended, over
    it, with no save between."""
    for name in ("A", "B"):  # A in slot 0, B in slot 1
        async with bed.request(name):
            pass
    body = json.dumps({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "C"}]}).encode()
    async with bed.library.pin("/v1/messages", body) as placed:
        planned = int(placed.header.split("slot=")[1].split(";")[0])
        other = 1 - planned
        held = asyncio.create_task(_turn(bed, "A" if other == 0 else "B"))
        await asyncio.sleep(0.25)
        assert not held.done(), "the other idle slot is held while the server may still give it to this request"
        bed.server.set_slot(planned, processing=True, task=next(bed.server.tasks))  # the server started it
        assert await asyncio.wait_for(held, 2) == other, "placed once a read showed the request started"
        bed.server.serve(planned, ids_of("C"))
        placed.answered(OK)


async def _turn(bed: Bed, name: str) -> int | None:
    async with bed.request(name) as slot:
        return slot


async def test_a_slot_the_server_shows_holding_nothing_is_given_to_a_swap_with_nothing_saved(bed: Bed) -> None:
    """Soak finding: the book counted a turn as ended in a slot that, read afresh, had run no task in this process
    (it only held a restore). The save for the swap was refused, "the slot holds nothing", and the request went
    unpinned: llama-server gave it the slot of its choice, over another conversation's unsaved turn."""
    for name in ("A", "B"):  # A in slot 0, B in slot 1
        async with bed.request(name):
            pass
    bed.server.set_slot(0, task=None, tokens=0)  # as the server shows it now: no task ran there
    async with bed.request("C") as slot:
        assert slot == 0, "placed in the slot that holds nothing to lose, pinned"
    assert ("save", 0) not in bed.actions()
