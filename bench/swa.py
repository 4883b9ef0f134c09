"""Sliding-window models at llama-server's defaults (no ``--swa-full``): the turn after a kill -9, vs no crash.

On Gemma 3 (the bed's gemma3-270m: a window of 512 in 5 of every 6 layers),
a tiny random-weight gpt-oss (``tests.support.tinymodels``: a window of 128
in every other layer, attention sinks, a mixture of experts) and a
random-weight Gemma 3 with an 8B-class KV (``tests.support.widekvswa``: 32
layers x 8 KV heads x 128 dims, 128 KiB per token were every layer global;
a window of 1,024 in 5 of every 6 layers, as Gemma 3 4B-27B), all
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

Run alone with ``python -m bench.swa [--quick] [--models gemma3,gpt-oss,wide]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from bench import beds, rig, section
from bench.beds import llamabed, net, tinymodels
from bench.hybrid_chat import Chat, Turn

REUSED = 0.99
"""Share of the previous prompt the turn after a kill -9 must reuse."""
TIME_GOAL = 1.1
"""That turn's time over the same turn on llama-server alone with no crash."""
CTX = 8192
MARGIN = 3
WIDE = "gemma3 8B-class KV (random)"
"""The model whose rewind cost is the section's reported figure."""


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


MODELS = {"gemma3": "gemma3-270m", "gpt-oss": "gpt-oss (tiny)", "wide": WIDE}
"""``--models`` keys and the names the tables use."""


def models(bed: rig.Rig, keys: Sequence[str] = tuple(MODELS)) -> list[tuple[str, Path]]:
    paths = {
        "gemma3": lambda: bed.model,
        "gpt-oss": lambda: tinymodels.windowed(tinymodels.Windowed.GPT_OSS, tokenizer_from=bed.model),
        "wide": lambda: beds.widekvswa.model(tokenizer_from=bed.model),
    }
    return [(MODELS[key], paths[key]()) for key in keys]


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


def run(bed: rig.Rig, *, quick: bool, say: rig.Say, keys: Sequence[str] = tuple(MODELS)) -> list[Trial]:
    tokens, trials = (1500, 3) if quick else (3000, 5)
    out: list[Trial] = []
    for name, path in models(bed, keys):
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


def rewind_cost(trials: list[Trial], model: str = WIDE) -> str:
    """The rewind's cost on ``model``: seconds per save and share of the turns' time (medians over the trials)."""
    mine = [t for t in trials if t.model == model and t.turns_ms > 0]
    if not mine:
        return f"swa: rewind at 8B-class KV: no trial of {model}"
    seconds = rig.median([t.rewind_s for t in mine])
    share = rig.median([t.rewind_s * 1000 / t.turns_ms for t in mine])
    return (
        f"swa: the rewind before a save at 8B-class KV ({model}, {beds.widekvswa.KV_BYTES_PER_TOKEN // 1024} KiB per "
        f"token were every layer global): {seconds:.2f} s, {share:.1%} of the two turns' time through the proxy "
        f"(medians of {len(mine)} trials: " + ", ".join(f"{t.rewind_s:.2f} s" for t in mine) + ")"
    )


def verdicts(trials: list[Trial]) -> list[str]:
    judged_lines = [f"{'MET' if met else 'MISSED':6}  {goal}: {measured}" for goal, measured, met in judged(trials)]
    return [*judged_lines, f"{'REPORT':6}  {rewind_cost(trials)}"]


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


def measure(bed: rig.Rig, *, quick: bool, say: rig.Say, keys: Sequence[str] = tuple(MODELS)) -> tuple[list[Trial], str]:
    trials = run(bed, quick=quick, say=say, keys=keys)
    return trials, table(trials)


def main(argv: list[str] | None = None) -> int:
    """``--models gemma3,gpt-oss,wide`` (the default: all three) picks the models; the other options are every
    section's (``--quick``, ``--out``, ``--threads``)."""
    chosen = argparse.ArgumentParser(add_help=False)
    chosen.add_argument("--models", default=",".join(MODELS))
    ns, rest = chosen.parse_known_args(argv)
    keys = [key for key in ns.models.split(",") if key]
    unknown = [key for key in keys if key not in MODELS]
    if unknown or not keys:
        print(f"--models: {', '.join(unknown) or 'none given'}; choose among {', '.join(MODELS)}", file=sys.stderr)
        return 2
    return section.main(
        rest,
        name="swa",
        doc=__doc__,
        title="Sliding-window models without --swa-full: the turn after a kill -9",
        quick_help="first messages of ~1,500 tokens, 3 trials per model",
        measure=functools.partial(measure, keys=keys),
        missed=lambda trials, quick: any(not met for _, _, met in judged(trials)),
    )


if __name__ == "__main__":
    sys.exit(main())
