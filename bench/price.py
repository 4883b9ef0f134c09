"""The proxy's price on every turn: through the proxy against straight to llama-server, per API, in one run.

One llama-server at its defaults but for the test bed's layout (4 slots of
8,192 tokens, ``-c 32768``, ``--swa-full``; the RAM prompt cache on) and one
sidecar with the proxy on, its own defaults. Measured side by side, each
way on its own keep-alive connection, alternating which goes first from one
timed turn of a kind to the next (so streamed and non-streamed turns each go
first half the time):

* **Warm turns**, per API the proxy routes (Chat Completions, Anthropic
  Messages, Responses, ``/completion``): two conversations of the same
  length (a system prompt, a tool and a history of ``tokens``, 2K-8K: long
  enough to be routed), one sent straight to llama-server, one through the
  proxy, each turn adding an assistant answer and a new user line, so every
  turn is a conversation's next one (the server reuses its prefix and
  prefills the new line; through the proxy the library routes it: template,
  tokens, slot). 30 non-streamed turns are timed to the answer's end
  (``max_tokens`` 1) and :data:`STREAMED` streamed ones (120) to the first
  byte of the answer's body, spread among each other (:func:`bench.price_turns.schedule`).
  Every :data:`bench.price_turns.SEGMENT` turns the conversation goes back to its history with
  a new line (its first two turns then are not timed), so that it stays
  inside its slot.
* **The same work**: after each turn, llama-server's compute for it (its
  prompt and generation seconds, its ``/metrics``) and the prompt tokens it
  processed. Where the proxied turn made the server process no more than the
  direct one (:data:`bench.price_figures.SAME_WORK_TOKENS`), it is counted with the direct
  turn's compute in place of its own (:func:`bench.price_figures._swapped`): the server's swing
  from turn to turn is taken out, what the proxy adds stays. The goals are
  judged on these; the figures as measured are printed beside them.
* **A spacer** (:class:`bench.price_turns.Spacer`): a one-token ``/completion`` on a third
  slot, straight to the server, after every timed turn, so that neither way
  waits for the server's work after the other's turn.
* **The proxy's CPU per request**: the sidecar's CPU time (all threads,
  ``schedstat``) over the proxied turns, its idle polling subtracted.
* **Non-routed requests** (``bench.proxy.NON_ROUTED``: ``/tokenize``, a
  ``/completion`` with its own ``id_slot``): the time the proxy adds at p50.
* **A turn after a kill -9**: a proxied chat's next turn sent the moment the
  restarted server answers ``/health`` (the sidecar's detection, restore and
  the gate on its path), against the same turn with no crash (both reuse the
  same prefix: each turn's new line starts with a word of its own), sent
  once the last crash's restore round has ended and a spacer has had the
  server copy the slots it restored into its RAM prompt cache.
  :data:`CRASHES` crashes (3 with ``--quick``).

Goals (MISSED and exit status 1 when missed): a warm turn at most
:data:`TURN_GOAL` x direct at p50, the first streamed byte at most
:data:`FIRST_BYTE_GOAL_MS` ms later, a non-routed request at most
:data:`NON_ROUTED_GOAL_MS` ms later at p50, and the turn after a crash at most
:data:`CRASH_GOAL` x the turn without. Each is taken over pairs: a turn (or
request) straight to the server and the same turn through the proxy, sent
one right after the other, give one ratio or difference; the median of the
pairs where the direct one went first and that of the pairs where the proxy
went first are averaged (see :func:`bench.price_figures._paired`); warm turns and first bytes
with the same work's compute (above). With ``--quick``, a goal whose figure
varies between rounds (the turns cut in :data:`ROUNDS`; each crash) by more
than its margin to the bar gets NO VERDICT; the full run decides.

Run alone with ``python -m bench.price [--quick]``, or as the ``price``
section of ``python -m bench``.
"""

from __future__ import annotations

import sys
from typing import Any

from bench import proxy as proxy_mod
from bench import rig, section
from bench.beds import llamabed, net, wait
from bench.price_figures import DIRECT, PROXY, SAME_WORK_TOKENS, Api, Crash, Result, non_routed_added
from bench.price_turns import APIS, CTX, SLOTS, run_crash, run_turns

TURN_GOAL = 1.03
"""A warm turn through the proxy over the direct one (p50s)."""
FIRST_BYTE_GOAL_MS = 3.0
"""Milliseconds the proxy may add to the first streamed byte (p50s)."""
NON_ROUTED_GOAL_MS = 1.0
"""Milliseconds the proxy may add to a request it does not route (p50s)."""
CRASH_GOAL = 1.2
"""The turn after a kill -9 (from /health ok) over the same turn with no crash (medians)."""
ROUNDS = 2
"""Rounds the turns are cut into, for the spread that decides whether a quick run can give a verdict."""
STREAMED = 120
"""Streamed turns timed per API and way in a full run (30 non-streamed): one streamed turn's time outside the
server's compute moves by 5-8 ms (interquartile range of the pairs' differences) from turn to turn, so 30 pairs
left the first-byte figure's median about 1.5 ms from where the next run put it, half the goal."""
CRASHES = 9
"""Crashes in a full run (each against the turn with no crash right before it)."""


def _parts(n: int) -> list[slice]:
    size = max(1, n // ROUNDS)
    return [slice(i * size, (i + 1) * size if i < ROUNDS - 1 else None) for i in range(ROUNDS)]


def run(bed: rig.Rig, *, tokens: int, reps: int, streamed: int, crashes: int, quick: bool, say: rig.Say) -> Result:
    slot_dir = bed.slot_dir("price")
    server = bed.server(slot_dir=slot_dir, n_slots=SLOTS, ctx_size=CTX)
    proxy_port = net.free_port()
    side = bed.sidecar(server, slot_dir, **{"--proxy-listen": f"127.0.0.1:{proxy_port}"})
    wait.wait_until(lambda: side.get("/readyz")[0] == 200, timeout=60, what="the sidecar ready")
    assert side.proc is not None
    pid = side.proc.pid
    ports = {DIRECT: server.port, PROXY: proxy_port}
    idle = proxy_mod.idle_rate(pid)
    apis = []
    for i, api in enumerate(APIS):
        history = (
            llamabed.make_prompt(server.url, tokens, seed=300 + 2 * i),
            llamabed.make_prompt(server.url, tokens, seed=301 + 2 * i),
        )
        say(f"  {api}: {reps} warm turns and {streamed} streamed each way, ~{tokens:,}-token histories")
        apis.append(run_turns(api, history, ports, pid, reps=reps, streamed=streamed, idle=idle, say=say))
    non_routed = proxy_mod.latencies(pid, ports, reps=100 if quick else 400, idle=idle, say=say)
    crash = run_crash(server, side, proxy_port, tokens=tokens, reps=crashes, say=say)
    side.kill()
    server.kill()
    return Result(tokens, apis, non_routed, crash, quick)


def judged(r: Result) -> list[tuple[str, str, bool | None]]:
    """(goal, measured, met: None for NO VERDICT) of each goal."""
    out: list[tuple[str, str, bool | None]] = []
    for a in r.apis:
        parts = _parts(len(a.turn_ms[PROXY]))
        rounds = [a.turn_ratio(p) for p in parts]
        out.append(
            (
                f"price: {a.name}, warm turn through the proxy <= {TURN_GOAL:g}x direct at p50",
                f"{a.turn_ratio():.3f}x for the same work ({a.ratio():.3f}x as measured, "
                f"{rig.median(a.turn_ms[PROXY]):.1f} vs {rig.median(a.turn_ms[DIRECT]):.1f} ms; "
                f"per round {', '.join(f'{v:.3f}' for v in rounds)})",
                rig.decide(a.turn_ratio(), TURN_GOAL, rounds=rounds, quick=r.quick),
            )
        )
    for a in r.apis:
        parts = _parts(len(a.first_ms[PROXY]))
        rounds = [a.first_added(p) for p in parts]
        out.append(
            (
                f"price: {a.name}, first streamed byte through the proxy <= +{FIRST_BYTE_GOAL_MS:g} ms at p50",
                f"{a.first_added():+.2f} ms for the same work ({a.added():+.2f} ms as measured, "
                f"{rig.median(a.first_ms[PROXY]):.1f} vs {rig.median(a.first_ms[DIRECT]):.1f} "
                f"ms; per round {', '.join(f'{v:+.2f}' for v in rounds)}; {a.different_work()} pairs of either "
                "kind where the proxy's turn made the server process more)",
                rig.decide(a.first_added(), FIRST_BYTE_GOAL_MS, rounds=rounds, quick=r.quick),
            )
        )
    for lat in r.non_routed:
        parts = _parts(len(lat.proxy_ms))
        rounds = [non_routed_added(lat, p) for p in parts]
        added = non_routed_added(lat)
        out.append(
            (
                f"price: non-routed {lat.route} adds <= {NON_ROUTED_GOAL_MS:g} ms at p50",
                f"{added:+.3f} ms ({rig.percentile(lat.proxy_ms, 50):.2f} vs {rig.percentile(lat.direct_ms, 50):.2f} "
                f"ms; per round {', '.join(f'{v:+.3f}' for v in rounds)}; {lat.cpu_us:.0f} µs CPU per request)",
                rig.decide(added, NON_ROUTED_GOAL_MS, rounds=rounds, quick=r.quick),
            )
        )
    c = r.crash
    out.append(
        (
            f"price: the turn after a kill -9 (from /health ok) <= {CRASH_GOAL:g}x the same turn with no crash",
            f"{c.ratio:.3f}x ({rig.median(c.crashed_ms):.1f} vs {rig.median(c.calm_ms):.1f} ms; per crash "
            f"{', '.join(f'{v:.2f}' for v in c.ratios)}; cache_n {min(c.cache_n)}-{max(c.cache_n)} after, "
            f"{min(c.calm_cache_n)}-{max(c.calm_cache_n)} without)",
            None
            if min(c.cache_n) < 0.9 * c.tokens
            else rig.decide(c.ratio, CRASH_GOAL, rounds=c.ratios, quick=r.quick),
        )
    )
    return out


def verdicts(r: Result) -> list[str]:
    return [f"{rig.word(met):10}  {goal}: {measured}" for goal, measured, met in judged(r)]


def from_json(raw: dict[str, Any]) -> Result:
    """A run's result as ``results.json`` holds it."""
    return Result(
        raw["tokens"],
        [Api(**a) for a in raw["apis"]],
        [proxy_mod.Latency(**n) for n in raw["non_routed"]],
        Crash(**raw["crash"]),
        raw["quick"],
    )


def table(r: Result) -> str:
    rows = [
        [a.name, len(a.turn_ms[PROXY]), rig.median(a.turn_ms[DIRECT]), rig.median(a.turn_ms[PROXY]),
         f"{a.turn_ratio():.3f}", f"{a.ratio():.3f}", rig.median(a.first_ms[DIRECT]), rig.median(a.first_ms[PROXY]),
         a.first_added(), a.added(), a.different_work(), a.cpu_us]
        for a in r.apis
    ]  # fmt: skip
    head = [
        "API", "n", "turn direct", "turn proxy", "ratio", "as measured", "1st byte direct", "1st byte proxy",
        "added", "as measured", "more work", "CPU µs",
    ]  # fmt: skip
    note = (
        f"(ms, p50; ratio and added: over pairs of turns, per order, each proxied turn given the direct turn's "
        f"server compute (its /metrics) where the server processed at most {SAME_WORK_TOKENS} more prompt tokens "
        "for it; as measured: without; more work: pairs where it processed more, counted as measured; "
        "a spacer request on a third slot after each timed turn; "
        f"{SLOTS} slots of {CTX:,} tokens, "
        f"RAM prompt cache on; histories of ~{r.tokens:,} tokens; "
        "a turn adds an answer and a line; CPU: the sidecar's per proxied request, its polling subtracted)"
    )
    c = r.crash
    crash = rig.table(
        ["turn", "n", "p50 ms", "runs ms", "cache_n"],
        [
            ["after kill -9, from /health ok", len(c.crashed_ms), rig.median(c.crashed_ms),
             "/".join(f"{v:.0f}" for v in c.crashed_ms), "/".join(map(str, c.cache_n))],
            ["no crash", len(c.calm_ms), rig.median(c.calm_ms), "/".join(f"{v:.0f}" for v in c.calm_ms),
             "/".join(map(str, c.calm_cache_n))],
        ],
    )  # fmt: skip
    non = rig.table(
        ["non-routed request", "n", "p50 direct", "p50 proxy", "added", "CPU µs"],
        [[n.route, len(n.direct_ms), rig.percentile(n.direct_ms, 50), rig.percentile(n.proxy_ms, 50),
          non_routed_added(n), n.cpu_us] for n in r.non_routed],
    )  # fmt: skip
    return "\n\n".join([rig.table(head, rows, digits=2) + "\n" + note, non, crash, "\n".join(verdicts(r))])


def measure(bed: rig.Rig, *, quick: bool, say: rig.Say) -> tuple[Result, str]:
    result = run(
        bed,
        tokens=2000 if quick else 4000,
        reps=12 if quick else 30,
        streamed=24 if quick else STREAMED,
        crashes=3 if quick else CRASHES,
        quick=quick,
        say=say,
    )
    return result, table(result)


def main(argv: list[str] | None = None) -> int:
    return section.main(
        argv,
        name="price",
        doc=__doc__,
        title="The proxy's price per turn",
        quick_help="shorter histories, fewer turns and crashes",
        measure=measure,
        missed=lambda result, quick: any(met is False for _, _, met in judged(result)),
    )


if __name__ == "__main__":
    sys.exit(main())
