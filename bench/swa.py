"""Sliding-window models at llama-server's defaults (no ``--swa-full``): the turn after a kill -9, vs no crash.

On Gemma 3 (the bed's gemma3-270m: a window of 512 in 5 of every 6 layers)
and a tiny random-weight gpt-oss (``tests.support.tinymodels``: a window of
128 in every other layer, attention sinks, a mixture of experts), both
without ``--swa-full``, as people run them: a chat conversation (a first
message of ``tokens`` tokens, an 8-token reply sent back as the server wrote
it) sends its second turn, side by side on two fresh servers with one slot:
llama-server alone, with no crash (its own cache and context checkpoints
serve the turn), and the sidecar's proxy in front of a llama-server that was
``kill -9``ed after the first turn and started again (the sidecar saved the
slot at its prompt's boundary and restored it). Each trial alternates which
path goes first. Timed: the streamed turn's wait for the first byte of its
body; the reuse is ``timings.cache_n`` over the previous prompt.

Goals, per model: the turn after the kill -9 reuses >= 99% of the previous
prompt, and takes <= 1.1x the same turn on llama-server alone with no crash
(the median of the trials' ratios). Reported beside: what the rewind to the
boundary cost (``slot_rewound_to_boundary``: seconds, and as a share of the
two turns' time through the proxy), and the cell added to each slot file.

Run alone with ``python -m bench.swa [--quick]``.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

from bench import rig, section
from bench.beds import llamabed, net, tinymodels
from bench.hybrid_chat import Chat, Turn

REUSED = 0.99
"""Share of the previous prompt the turn after a kill -9 must reuse."""
TIME_GOAL = 1.1
"""That turn's time over the same turn on llama-server alone with no crash."""
CTX = 8192
MARGIN = 3


@dataclasses.dataclass(frozen=True, slots=True)
class Trial:
    model: str
    alone: Turn
    """The second turn on llama-server alone, no crash."""
    restored: Turn
    """The second turn through the proxy, after a kill -9 and the sidecar's restore."""
    rewind_s: float
    """The sidecar's rewinds to the boundary in this trial, seconds."""
    turns_ms: float
    """Both turns through the proxy, ms to first byte."""

    @property
    def ratio(self) -> float:
        return self.restored.ttft_ms / self.alone.ttft_ms


def models(bed: rig.Rig) -> list[tuple[str, Path]]:
    gpt_oss = tinymodels.windowed(tinymodels.Windowed.GPT_OSS, tokenizer_from=bed.model)
    return [("gemma3-270m", bed.model), ("gpt-oss (tiny)", gpt_oss)]


def _trial(bed: rig.Rig, name: str, model: Path, *, tokens: int, seed: int, proxy_first: bool, say: rig.Say) -> Trial:
    alone_dir, proxy_dir = bed.slot_dir("swa-alone"), bed.slot_dir("swa-proxy")
    alone = bed.server(slot_dir=alone_dir, n_slots=1, ctx_size=CTX, model=model, swa_full=False, alone=False)
    served = bed.server(slot_dir=proxy_dir, n_slots=1, ctx_size=CTX, model=model, swa_full=False, alone=False)
    port = net.free_port()
    side = bed.sidecar(served, proxy_dir, **{"--proxy-listen": f"127.0.0.1:{port}"})
    side.wait_for(lambda: side.get("/readyz")[0] == 200, timeout=60, what="the sidecar ready")
    proxy = f"http://127.0.0.1:{port}"
    text = llamabed.make_prompt(alone.url, tokens, seed=seed)
    chats = {"alone": Chat(0, text), "proxy": Chat(0, text)}
    first = {"alone": chats["alone"].turn(alone.url), "proxy": chats["proxy"].turn(proxy)}
    want = chats["proxy"].prompt_tokens - MARGIN
    side.wait_for(
        lambda: any(int(e.get("tokens", 0)) == want for e in side.log_events("snapshot_committed")),
        timeout=120,
        what="the first turn saved at its prompt's boundary",
    )
    served.restart()
    side.wait_restored(1, timeout=120)
    order = ["proxy", "alone"] if proxy_first else ["alone", "proxy"]
    second: dict[str, Turn] = {}
    for path in order:
        second[path] = chats[path].turn(proxy if path == "proxy" else alone.url)
    rewind_s = sum(float(e["seconds"]) for e in side.log_events("slot_rewound_to_boundary"))
    side.kill()
    served.kill()
    alone.kill()
    trial = Trial(name, second["alone"], second["proxy"], rewind_s, first["proxy"].ttft_ms + second["proxy"].ttft_ms)
    say(
        f"  {name}: after kill -9 {trial.restored.cache_n} of {trial.restored.previous} reused, "
        f"{trial.restored.ttft_ms:.0f} ms vs {trial.alone.ttft_ms:.0f} ms alone, no crash ({trial.ratio:.2f}x); "
        f"rewind {rewind_s * 1000:.0f} ms"
    )
    return trial


def run(bed: rig.Rig, *, quick: bool, say: rig.Say) -> list[Trial]:
    tokens, trials = (1500, 3) if quick else (3000, 5)
    out: list[Trial] = []
    for name, path in models(bed):
        for n in range(trials):
            out.append(_trial(bed, name, path, tokens=tokens, seed=500 + n, proxy_first=n % 2 == 0, say=say))
    return out


def judged(trials: list[Trial]) -> list[tuple[str, str, bool]]:
    out: list[tuple[str, str, bool]] = []
    for name in dict.fromkeys(t.model for t in trials):
        mine = [t for t in trials if t.model == name]
        worst = min(mine, key=lambda t: t.restored.reuse)
        out.append((
            f"swa: {name}, no --swa-full, the turn after a kill -9 reuses >= {REUSED:.0%} of the previous prompt",
            f"at least {worst.restored.reuse:.1%} ({worst.restored.cache_n:,} of {worst.restored.previous:,}; "
            f"{len(mine)} trials)",
            worst.restored.reuse >= REUSED,
        ))  # fmt: skip
        ratio = rig.median([t.ratio for t in mine])
        out.append((
            f"swa: {name}, that turn <= {TIME_GOAL:g}x the same turn on llama-server alone with no crash",
            f"{ratio:.2f}x (median of {len(mine)} trials' ratios: "
            + ", ".join(f"{t.ratio:.2f}" for t in mine)
            + ")",
            ratio <= TIME_GOAL,
        ))  # fmt: skip
    return out


def verdicts(trials: list[Trial]) -> list[str]:
    return [f"{'MET' if met else 'MISSED':6}  {goal}: {measured}" for goal, measured, met in judged(trials)]


def table(trials: list[Trial]) -> str:
    rows: list[list[object]] = []
    for t in trials:
        share = t.rewind_s * 1000 / t.turns_ms if t.turns_ms else math.nan
        rows.append([
            t.model, t.restored.previous, f"{t.alone.reuse:.1%}", f"{t.restored.reuse:.1%}", t.alone.ttft_ms,
            t.restored.ttft_ms, t.ratio, t.rewind_s * 1000, f"{share:.1%}",
        ])  # fmt: skip
    head = ["model", "previous prompt", "alone reuse", "after kill -9 reuse", "alone ms", "after kill -9 ms",
            "x alone", "rewind ms", "rewind / turns"]  # fmt: skip
    note = (
        "-np 1, no --swa-full; the second turn of a chat: on llama-server alone with no crash, and through the "
        "proxy after a kill -9 and the restore; ms = streamed, to the first byte of the body; rewind = the "
        "sidecar's step to the prompt's boundary before its save (its share of the two turns' time through the "
        "proxy)\n\n"
    )
    return note + rig.table(head, rows, digits=2) + "\n\n" + "\n".join(verdicts(trials))


def measure(bed: rig.Rig, *, quick: bool, say: rig.Say) -> tuple[list[Trial], str]:
    trials = run(bed, quick=quick, say=say)
    return trials, table(trials)


def main(argv: list[str] | None = None) -> int:
    return section.main(
        argv,
        name="swa",
        doc=__doc__,
        title="Sliding-window models without --swa-full: the turn after a kill -9",
        quick_help="first messages of ~1,500 tokens, 3 trials per model",
        measure=measure,
        missed=lambda trials, quick: any(not met for _, _, met in judged(trials)),
    )


if __name__ == "__main__":
    sys.exit(main())
