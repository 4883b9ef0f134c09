"""Hybrid models: per-turn reuse and time to first token, llama-server alone vs beside vs through the proxy.

On a model whose state cannot be cut back (a tiny random-weight ``qwen35``,
Gated DeltaNet + attention, and ``lfm2``, short convolutions + attention:
``tests.support.tinymodels``; both with ``--quick`` too) and, next to it, the
dense test model (gemma3-270m, ``--swa-full``): two chat conversations (a first message of ``tokens``
tokens, then one-line follow-ups; each 8-token reply sent back as the
server wrote it, so the chat template re-renders it) take turns on one slot
(``-np 1``, the server's default RAM cache), on three fresh servers:
llama-server alone, with the sidecar beside it (clients talk to the server),
and through the sidecar's proxy. Each turn is streamed; timed is the wait
for the first byte of the answer's body (llama-server sends it with the
first token), and the server's ``timings.cache_n`` over the conversation's
previous prompt is its reuse. With the sidecar, the next turn is sent once
the slot's snapshot is committed (the boundary step ran while the slot was
idle, as between a user's turns; ``--idle-seconds 0.5`` to keep the pauses
short). Then llama-server is killed with SIGKILL
and started again, and (once the sidecar restored the slot) each
conversation sends one more turn, the one the slot held last first.

Goals (from issue 20), per model: through the proxy every turn after the
first reuses >= 90% of its conversation's previous prompt, and so do both
conversations' first turns after the kill -9; beside the server, the first
turn after the kill -9 reuses >= 90%; the median warm-turn time to first
token beside and through the proxy at most ``TTFT_GOAL`` x llama-server
alone's (never worse than no sidecar, within the bar the agents section
allows the proxy's routing).

The boundary step's own cost: beside the server, on each model, the next
turn is sent the moment the sidecar's idle-time save of the slot starts (a
scratch file appears in the slot dir: on a hybrid the step's save of the
slot's token ids) and timed against a turn sent once that snapshot is
committed, alternately. The difference is what the step adds to the time
to first token of a request that arrives while it runs. Through the proxy,
the other conversation's turn sent at once after a turn (its swap saves the
slot first, the boundary step included, on its path) is timed against one
sent after the pause. And on llama-server alone, the other way to a
boundary state, emulated (see :func:`_boundary_first`). No goals: figures.

Run alone with ``python -m bench.hybrid [--quick]``, or as the ``hybrid``
section of ``python -m bench``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from pathlib import Path

from bench import rig, section
from bench.beds import llamabed, net, sidecarbed
from bench.hybrid_chat import ALONE, BESIDE, MODES, PROXY, REPLY_TOKENS, Chat, Model, Result, Run, Turn, models

WARM = 0.9
"""Share of a conversation's previous prompt a turn must find cached."""
TTFT_GOAL = 1.25
"""Median warm-turn time to first token beside or through the proxy over llama-server alone's."""
CTX = 8192
SCRATCH = ".tmp-"
"""How the sidecar's scratch and in-flight files in the slot dir begin (``snapshots.slotdir.TEMP_PREFIX``)."""
IDLE_SECONDS = "0.5"
"""The sidecar's ``--idle-seconds`` here (default 2.0): the user's pause between two turns, which waits for the
slot's snapshot, is shorter; nothing timed depends on it."""
MARGIN = 3
"""A boundary snapshot ends this many tokens before its prompt's end (``save.boundary.MARGIN``)."""


def _commits(side: sidecarbed.SidecarProcess) -> int:
    return len(side.log_events("snapshot_committed"))


def _wait_committed(side: sidecarbed.SidecarProcess, mark: int, tokens: int) -> None:
    """Wait for a snapshot committed after the ``mark``-th of at least ``tokens`` tokens (the turn just sent)."""
    side.wait_for(
        lambda: any(int(e.get("tokens", 0)) >= tokens for e in side.log_events("snapshot_committed")[mark:]),
        timeout=120,
        what=f"a snapshot of the slot's last turn ({tokens:,} tokens or more)",
    )


def _scratch(slot_dir: Path) -> bool:
    return any(name.startswith(SCRATCH) for name in os.listdir(slot_dir))


def _save_starts(side: sidecarbed.SidecarProcess, slot_dir: Path, mark: int, *, timeout: float = 60.0) -> bool:
    """Wait for the sidecar's next save of the slot to start (a scratch file appears); False: it was missed."""
    deadline = time.monotonic() + timeout
    n = 0
    while time.monotonic() < deadline:
        if _scratch(slot_dir):
            return True
        n += 1
        if n % 200 == 0 and _commits(side) > mark:
            return False  # committed between two looks at the slot dir
        time.sleep(0.0005)
    raise rig.BenchError(f"no save of the slot started within {timeout:.0f} s")


def _collide(
    side: sidecarbed.SidecarProcess, url: str, slot_dir: Path, chat: Chat, trials: int
) -> tuple[list[Turn], list[Turn]]:
    """Alternately: a turn sent the moment the idle-time save starts, and one sent once it is committed."""
    collided: list[Turn] = []
    quiet: list[Turn] = []
    chat.turn(url)  # the turn whose idle-time save the first collided turn meets
    mark = _commits(side)
    while len(collided) < trials:
        if not _save_starts(side, slot_dir, mark):
            chat.turn(url)  # missed: try again on the next turn's save
            mark = _commits(side)
            continue
        collided.append(chat.turn(url))
        mark = _commits(side)
        _wait_committed(side, mark, chat.prompt_tokens - MARGIN)
        quiet.append(chat.turn(url))
        mark = _commits(side)
    _wait_committed(side, mark, chat.prompt_tokens - MARGIN)
    return collided, quiet


def _boundary_first(url: str, chat: Chat, trials: int) -> tuple[list[Turn], list[Turn]]:
    """Alternately: a turn preceded by the other way to a boundary state, and a plain turn.

    The other way (not built: a proxy would do it before forwarding): the prompt's first P - MARGIN ids are
    processed on the slot with ``n_predict`` 1, the slot is saved, then the request is sent. Emulated here
    on llama-server alone; the turn is timed from the first of those calls (the ids are what routing has
    already).
    """
    first: list[Turn] = []
    plain: list[Turn] = []
    for _ in range(trials):
        templated = llamabed.call("POST", url + "/apply-template", {"messages": chat.messages})["prompt"]
        body = {"content": templated, "add_special": True, "parse_special": True}
        ids = llamabed.call("POST", url + "/tokenize", body)["tokens"]
        started = time.perf_counter()
        ahead = {"prompt": ids[:-MARGIN], "n_predict": 1, "id_slot": 0, "cache_prompt": True, "temperature": 0}
        llamabed.call("POST", url + "/completion", ahead)
        llamabed.slot_action(url, 0, "save", "boundary-first.bin")
        before_ms = (time.perf_counter() - started) * 1000
        turn = chat.turn(url)
        first.append(dataclasses.replace(turn, ttft_ms=turn.ttft_ms + before_ms))
        plain.append(chat.turn(url))
    return first, plain


def _hurried(
    side: sidecarbed.SidecarProcess, url: str, chats: list[Chat], trials: int
) -> tuple[list[Turn], list[Turn]]:
    """Through the proxy, alternately: the other chat's turn sent at once after a turn (its swap saves the slot
    first, the boundary step included on a hybrid, on the request's path), and one sent after the pause."""
    hurried: list[Turn] = []
    paused: list[Turn] = []
    one, other = chats
    for _ in range(trials):
        one.turn(url)
        hurried.append(other.turn(url))
        _wait_committed(side, _commits(side), other.prompt_tokens - MARGIN)
        one.turn(url)
        _wait_committed(side, _commits(side), one.prompt_tokens - MARGIN)
        paused.append(other.turn(url))
        _wait_committed(side, _commits(side), other.prompt_tokens - MARGIN)
    return hurried, paused


def _run(bed: rig.Rig, model: Model, mode: str, *, tokens: int, turns: int, trials: int, say: rig.Say) -> Run:
    slot_dir = bed.slot_dir(f"hybrid-{mode}")
    server = bed.server(slot_dir=slot_dir, n_slots=1, ctx_size=CTX, model=model.path, swa_full=model.swa_full)
    side, url = None, server.url
    if mode != ALONE:
        port = net.free_port()
        options = {"--idle-seconds": IDLE_SECONDS}
        if mode == PROXY:
            options["--proxy-listen"] = f"127.0.0.1:{port}"
        side = bed.sidecar(server, slot_dir, **options)
        side.wait_for(lambda: side.get("/readyz")[0] == 200, timeout=60, what="the sidecar ready")
        if mode == PROXY:
            url = f"http://127.0.0.1:{port}"
    chats = [Chat(n, llamabed.make_prompt(server.url, tokens + 40 * n, seed=900 + n)) for n in range(2)]
    done: list[Turn] = []

    def turn(chat: Chat) -> Turn:
        sent = chat.turn(url)
        if side is not None:  # the user's pause: the slot's snapshot is made while it is idle
            _wait_committed(side, _commits(side), chat.prompt_tokens - MARGIN)
        return sent

    for _ in range(turns):
        done += [turn(chat) for chat in chats]
        say(f"  {model.name} {mode}: turn {done[-1].turn}, reuse {[_pct(t.reuse) for t in done[-2:]]}")
    restored = side.metric("llama_sidecar_restores_total", slot="0", result="ok") if side is not None else 0.0
    server.restart()
    if side is not None:
        side.wait_restored(int(restored) + 1)
    after = [turn(chat) for chat in reversed(chats)]
    say(f"  {model.name} {mode}: after kill -9, reuse {[_pct(t.reuse) for t in after]}")
    collided: tuple[list[Turn], list[Turn]] = ([], [])
    if side is not None and mode == BESIDE and trials:
        collided = _collide(side, url, slot_dir, chats[0], trials)
        say(f"  {model.name} {mode}: {trials} turns met the idle-time save, {trials} came after it")
    if side is not None and mode == PROXY and trials:
        collided = _hurried(side, url, chats, trials)
        say(f"  {model.name} {mode}: {trials} swaps right after a turn, {trials} after the pause")
    ahead: tuple[list[Turn], list[Turn]] = ([], [])
    if mode == ALONE and trials:
        ahead = _boundary_first(url, chats[0], trials)
        say(f"  {model.name} {mode}: {trials} turns with the boundary state made first, {trials} without")
    steps = [float(e["seconds"]) for e in side.log_events("slot_rewound_to_boundary")] if side is not None else []
    if side is not None:
        side.kill()
    server.kill()
    return Run(model.name, mode, done, after, collided[0], collided[1], ahead[0], ahead[1], steps)


def run(bed: rig.Rig, *, quick: bool, say: rig.Say) -> Result:
    tokens = 1000 if quick else 3000
    runs = []
    for model in models(bed):
        for mode in MODES:
            runs.append(
                _run(bed, model, mode, tokens=tokens, turns=4 if quick else 6, trials=3 if quick else 6, say=say)
            )
    return Result(tokens, runs)


def _pct(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.0%}"


def _median_ms(turns: list[Turn]) -> float:
    return rig.median([t.ttft_ms for t in turns])


def _server_ms(turns: list[Turn]) -> float:
    return rig.median([t.server_ms for t in turns])


def ttft_ratio(result: Result, model: str, mode: str) -> float:
    """Median warm-turn time to first token in ``mode`` over llama-server alone's."""
    return _median_ms(result.run(model, mode).warm) / _median_ms(result.run(model, ALONE).warm)


def table(result: Result) -> str:
    parts = []
    for model in result.models:
        runs = [result.run(model, mode) for mode in MODES]
        rows: list[list[object]] = []
        for i, first in enumerate(runs[0].turns):
            rows.append(
                [str(first.turn), str(first.chat), first.previous or "-", *(_pct(r.turns[i].reuse) for r in runs),
                 *(r.turns[i].ttft_ms for r in runs)]
            )  # fmt: skip
        for i, first in enumerate(runs[0].after_kill):
            rows.append(
                ["kill -9", str(first.chat), first.previous, *(_pct(r.after_kill[i].reuse) for r in runs),
                 *(r.after_kill[i].ttft_ms for r in runs)]
            )  # fmt: skip
        rows.append(
            ["warm median", "", "", *(_pct(rig.median([t.reuse for t in r.warm])) for r in runs),
             *(_median_ms(r.warm) for r in runs)]
        )  # fmt: skip
        ratios = [ttft_ratio(result, model, mode) for mode in MODES]
        rows.append(["warm x alone", "", "", "", "", "", *ratios])
        head = ["turn", "chat", "previous prompt", *(f"{m} reuse" for m in MODES), *(f"{m} ms" for m in MODES)]
        parts.append(
            f"### {model}\n\n"
            + rig.table(head, rows, digits=1)
            + "\n\n"
            + collision(runs[1])
            + hurried(runs[2])
            + ahead_first(runs[0])
        )
    note = (
        f"-np 1, two chats (first messages of ~{result.tokens:,} tokens) taking turns, {REPLY_TOKENS}-token replies "
        "re-rendered; reuse = timings.cache_n / the conversation's previous prompt; ms = streamed, to the first "
        "byte of the body\n\n"
    )
    return note + "\n\n".join(parts) + "\n\n" + "\n".join(verdicts(result))


def collision(beside: Run) -> str:
    """What the idle-time save (with the boundary step on a hybrid) adds to a turn that arrives while it runs."""
    if not beside.collided:
        return ""
    added = _median_ms(beside.collided) - _median_ms(beside.quiet)
    steps = f"; boundary step median {rig.median(beside.step_s) * 1000:.1f} ms" if beside.step_s else " (no step)"
    return (
        f"beside, a turn sent as the idle-time save starts: median {_median_ms(beside.collided):.1f} ms vs "
        f"{_median_ms(beside.quiet):.1f} ms after it ({added:+.1f} ms, {len(beside.collided)} of each; reuse "
        f"at least {_pct(min(t.reuse for t in beside.collided))} and {_pct(min(t.reuse for t in beside.quiet))})"
        + steps
    )


def hurried(proxy: Run) -> str:
    """What saving the slot first (the boundary step on a hybrid) adds to a swap on the request's path."""
    if not proxy.collided:
        return ""
    added = _median_ms(proxy.collided) - _median_ms(proxy.quiet)
    return (
        f"\nthrough the proxy, the other chat's turn sent at once after a turn (its swap saves the slot first, on "
        f"its path): median {_median_ms(proxy.collided):.1f} ms vs {_median_ms(proxy.quiet):.1f} ms after the pause "
        f"({added:+.1f} ms, {len(proxy.collided)} of each; reuse at least {_pct(min(t.reuse for t in proxy.collided))})"
    )


def ahead_first(alone: Run) -> str:
    """What making the boundary state before forwarding (the way not built) adds to every turn."""
    if not alone.first:
        return ""
    added = _median_ms(alone.first) - _median_ms(alone.plain)
    return (
        f"\nthe other way, the boundary state made before each request (emulated on llama-server alone: the "
        f"prompt's first P - {MARGIN} ids with n_predict 1, a save, then the request): median "
        f"{_median_ms(alone.first):.1f} ms vs {_median_ms(alone.plain):.1f} ms without ({added:+.1f} ms on every "
        f"turn, {len(alone.first)} of each)"
    )


def judged(result: Result) -> list[tuple[str, str, bool | None]]:
    """(goal, measured, met) per model."""
    out: list[tuple[str, str, bool | None]] = []
    for model in result.models:
        alone, beside, proxy = (result.run(model, mode) for mode in MODES)
        worst = min(proxy.warm, key=lambda t: t.reuse)
        out.append((
            f"hybrid: {model}, through the proxy every later turn reuses >= {WARM:.0%} of its previous prompt",
            f"at least {worst.reuse:.1%} (turn {worst.turn} of chat {worst.chat}: {worst.cache_n:,} of "
            f"{worst.previous:,}; llama-server alone at least {_pct(min(t.reuse for t in alone.warm))})",
            worst.reuse >= WARM,
        ))  # fmt: skip
        back = min(t.reuse for t in proxy.after_kill)
        out.append((
            f"hybrid: {model}, through the proxy both conversations' first turns after kill -9 reuse >= {WARM:.0%}",
            " and ".join(f"{t.cache_n:,} of {t.previous:,}" for t in proxy.after_kill) + f" (at least {back:.1%})",
            back >= WARM,
        ))  # fmt: skip
        first = beside.after_kill[0]
        out.append((
            f"hybrid: {model}, beside the server the first turn after kill -9 reuses >= {WARM:.0%}",
            f"{first.reuse:.1%} ({first.cache_n:,} of {first.previous:,}; the other conversation "
            f"{_pct(beside.after_kill[1].reuse)}: beside a 1-slot server nothing restores it)",
            first.reuse >= WARM,
        ))  # fmt: skip
        for mode in (BESIDE, PROXY):
            ratio = ttft_ratio(result, model, mode)
            out.append((
                f"hybrid: {model}, warm-turn time to first token {mode} <= {TTFT_GOAL:g}x llama-server alone",
                f"{ratio:.2f}x (median {_median_ms(result.run(model, mode).warm):.1f} ms vs "
                f"{_median_ms(alone.warm):.1f} ms alone; the server's own prompt_ms "
                f"{_server_ms(result.run(model, mode).warm):.1f} vs {_server_ms(alone.warm):.1f})",
                ratio <= TTFT_GOAL,
            ))  # fmt: skip
    return out


def verdicts(result: Result) -> list[str]:
    return [f"{'MET' if met else 'MISSED':6}  {goal}: {measured}" for goal, measured, met in judged(result)]


def measure(bed: rig.Rig, *, quick: bool, say: rig.Say) -> tuple[Result, str]:
    result = run(bed, quick=quick, say=say)
    return result, table(result)


def main(argv: list[str] | None = None) -> int:
    return section.main(
        argv,
        name="hybrid",
        doc=__doc__,
        title="Hybrid models: reuse and time to first token per turn",
        quick_help="4 turns of each chat, first messages of ~1,000 tokens",
        measure=measure,
        missed=lambda result, quick: any(met is False for _, _, met in judged(result)),
    )


if __name__ == "__main__":
    sys.exit(main())
