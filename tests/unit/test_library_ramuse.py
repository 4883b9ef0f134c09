"""Whether a slot may leave for llama-server's RAM cache unsaved: never on a model whose state cannot be cut
back, where the RAM copy serves the next turn only up to its newest context checkpoint."""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import pytest
from prometheus_client import CollectorRegistry

from sidecar.core import events, metrics
from sidecar.library import ramtier, ramuse, slotstate

CHAIN = ("a", "b", "c")


@dataclasses.dataclass(frozen=True)
class _Index:
    chain: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class _Record:
    owner: str
    index: _Index
    tokens: int


class _Library:
    """The store as RamUse reads it: one snapshot of the conversation, two of its three blocks."""

    def library(self) -> list[_Record]:
        return [_Record("", _Index(CHAIN[:2]), 512)]


def _use() -> ramuse.RamUse:
    tier = ramtier.RamTier(1 << 30)
    tier.served()  # shown to work on this server
    return ramuse.RamUse(
        tier=tier,
        snapshots=cast(Any, _Library()),
        stats=metrics.Metrics(CollectorRegistry(), version="t"),
        max_unsaved=60.0,
    )


@pytest.mark.parametrize(
    ("kind", "leaves"),
    [
        (events.Memory.ATTENTION, True),
        (events.Memory.SWA_FULL, True),
        (None, True),
        (events.Memory.SWA, False),
        (events.Memory.HYBRID, False),
        (events.Memory.RECURRENT, False),
    ],
)
def test_a_slot_leaves_unsaved_only_where_the_ram_copy_serves_all_of_it(
    kind: events.Memory | None, leaves: bool
) -> None:
    state = slotstate.SlotState()
    state.holds(CHAIN, owner="")
    view = events.SlotView(id=0, n_ctx=4096, processing=False, task=7, tokens=768)
    counters = events.Counters(start_time=1.0, prompt_tokens=10_000, cached_tokens=0, prompt_seconds=10.0)
    assert _use().leaves_unsaved(state, view, counters, kind) is leaves
