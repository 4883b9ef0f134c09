"""Claude Code and Codex themselves, through the proxy of a launcher, with ``kill -9`` of llama-server between turns.

The sidecar runs in launcher mode (``run ... -- llama-server ...``) with the
test model on 2 slots; the CLIs (see :mod:`tests.support.agentclis`) talk to its
proxy as users run them: ``claude -p`` and ``claude -p --resume``, ``codex
exec`` and ``codex exec resume``. Between turns the test kills llama-server
with SIGKILL and the launcher starts it again; the next turn waits at the
restore gate. Every turn that returns after a kill must reuse at least 99%
of its session's previous prompt, as llama-server counts it (its own log
lines in the launcher's log: counts only, no text).

Codex also runs two sessions in turn on the 2 slots. They share all but
their last ~60 tokens (instructions, tools, environment), so the second
takes the first's slot; when a session comes back after the other took its
slot, the library matches whole 128-token blocks and the session reuses
every whole block of its previous prompt (about 98% of a 2.7K-token prompt):
the partial block is prefilled again.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sidecar.snapshots import slotfile
from tests.support.agentclis import ClaudeCode, Codex, Launched, Tripwire, Turn, saved, turn

WARM = 0.99


@pytest.fixture
def launched(llama_binary: Path, model: Path, tmp_path: Path) -> Iterator[Launched]:
    slots = tmp_path / "slots"
    slots.mkdir()
    side = Launched(llama_binary, model, slots, tmp_path / "sidecar.log")
    with side:
        yield side.ready()


@pytest.fixture
def wire() -> Iterator[Tripwire]:
    """Where the CLIs' traffic to anywhere but the proxy goes (the test fails on any)."""
    tripwire = Tripwire()
    yield tripwire
    tripwire.close()


def _stayed_local(wire: Tripwire) -> None:
    assert not wire.asked, f"a CLI tried to reach beyond the proxy: {wire.asked}"


def _kill_child(side: Launched, after: Turn) -> None:
    """Once what ``after`` left in its slot is saved, ``kill -9`` of llama-server; the launcher starts it again."""
    saved(side, after.last)
    os.kill(side.child_pid(), signal.SIGKILL)


def _cold(turn: Turn, what: str) -> str:
    return f"{what} {turn.first.prompt} tokens, {turn.first.processed} prefilled, in {turn.seconds:.1f} s"


def _warm(turn: Turn, before: Turn, what: str, *, whole_blocks: bool = False) -> str:
    """The turn's first request reused at least 99% of the session's previous prompt.

    ``whole_blocks``: the session's slot was taken by the other session, which shares all but its tail: the
    library matches whole blocks of :data:`slotfile.BLOCK_TOKENS`, so the turn reuses every whole block of
    its previous prompt and may prefill the partial one again (up to 127 tokens).
    """
    assert turn.session == before.session, f"{what} the CLI did not resume its session"
    previous, reused = before.last.prompt, turn.first.cached
    share = reused / previous
    least = previous - previous % slotfile.BLOCK_TOKENS if whole_blocks else WARM * previous
    assert reused >= least, f"{what} reused {reused} of the previous prompt's {previous} tokens ({share:.1%})"
    return f"{what} {reused}/{previous} ({share:.1%}) in {turn.seconds:.1f} s"


def _killed_twice(side: Launched) -> None:
    exits = [(e["cause"], e["signal"]) for e in side.log_events("server_exited")]
    assert exits == [("killed", "SIGKILL")] * 2


def test_claude_code_resumed_after_each_kill_9_is_warm(
    launched: Launched, wire: Tripwire, tmp_path: Path, figure: Callable[[str], None]
) -> None:
    claude = ClaudeCode(launched.proxy, tmp_path, wire)
    started = time.monotonic()
    turns = [turn(launched, claude, "Say hello.")]
    notes = [_cold(turns[0], "turn 1 cold:")]
    for n, prompt in ((2, "And again?"), (3, "Once more?")):
        _kill_child(launched, turns[-1])
        turns.append(turn(launched, claude, prompt, resume=turns[-1].session))
        notes.append(_warm(turns[-1], turns[-2], f"turn {n} after kill -9:"))
    _killed_twice(launched)
    _stayed_local(wire)
    requests = [len(t.requests) for t in turns]
    figure(f"Claude Code: {'; '.join(notes)}; requests per turn {requests}; {time.monotonic() - started:.0f} s in all")


def test_codex_resumed_after_kill_9_and_switching_sessions_is_warm(
    launched: Launched, wire: Tripwire, tmp_path: Path, figure: Callable[[str], None]
) -> None:
    codex = Codex(launched.proxy, tmp_path, wire)
    started = time.monotonic()
    a1 = turn(launched, codex, "Say hello.")
    notes = [_cold(a1, "A1 cold:")]
    _kill_child(launched, a1)
    a2 = turn(launched, codex, "And again?", resume=a1.session)
    notes.append(_warm(a2, a1, "A2 after kill -9:"))
    b1 = turn(launched, codex, "Say goodbye.")
    assert b1.session != a1.session
    notes.append(_cold(b1, "B1 new session:"))
    a3 = turn(launched, codex, "Once more?", resume=a1.session)
    notes.append(_warm(a3, a2, "A3 after B1 (switch):", whole_blocks=True))
    _kill_child(launched, a3)
    b2 = turn(launched, codex, "And again?", resume=b1.session)
    notes.append(_warm(b2, b1, "B2 after kill -9 (switch):", whole_blocks=True))
    _killed_twice(launched)
    _stayed_local(wire)
    figure(f"Codex: {'; '.join(notes)}; {time.monotonic() - started:.0f} s in all")
