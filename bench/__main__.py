"""`python -m bench`: run the benchmarks, print tables, write a PNG and a JSON.

The sections are the rows of `bench/sections.py` (all by default, or a subset with `--only`).
Progress goes to stderr, results to stdout, ending with one verdict line per
goal (MET, MISSED or NO VERDICT, with the figures).
The exit status is 1 when a goal was missed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

from bench import REPO_ROOT, goals, machine, plot, rig, sections
from bench.sections import say


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument(
        "--quick", action="store_true", help="small sizes, few repetitions (about 19 minutes on 2 cores)"
    )
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "out", help="PNG, JSON and logs go here")
    parser.add_argument("--sizes", default="", help="prompt sizes in tokens for ttft, e.g. 1024,2048,4096,8192,12288")
    parser.add_argument("--restarts", type=int, default=0, help="kill -9 restarts to time (default 20; 5 quick)")
    parser.add_argument("--replot", action="store_true", help="only redraw DIR/bench.png from DIR/results.json")
    parser.add_argument("--threads", type=int, default=2, help="llama-server -t (default 2)")
    names = ",".join(sections.NAMES)
    parser.add_argument("--only", default=names, help=f"comma-separated subset of {names}")
    ns = parser.parse_args(argv)
    unknown = set(ns.only.split(",")) - set(sections.NAMES)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {names}")
    return ns


def show(title: str, body: str, load: tuple[str, str]) -> None:
    print(f"\n## {title}\n({load[0]} at start, {load[1]} at end)\n", flush=True)
    print(body, flush=True)


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    ns = parse(argv)
    # Servers and sidecars are killed in a `finally`: make SIGTERM and SIGINT (ignored when started in
    # the background) unwind to it.
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    p = sections.plan(ns)
    only = set(ns.only.split(","))
    out: Path = ns.out
    if ns.replot:
        return _replot(out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    bed = rig.Rig(log_dir=out / f"logs-{stamp}", threads=ns.threads)
    raw: dict[str, Any] = {"plan": dataclasses.asdict(p), "quick": bool(ns.quick), "loads": {}}
    results = goals.Results()
    own: dict[str, list[str]] = {}  # the verdict lines of the sections goals.judge does not judge
    started = time.monotonic()
    try:
        probe = bed.server(slot_dir=bed.slot_dir("probe"), n_slots=1, ctx_size=2048)
        info = machine.describe(bed, machine.build_info(probe.url))
        probe.kill()
        raw["machine"] = dataclasses.asdict(info)
        load0 = rig.loadavg()
        raw["loads"]["start"] = load0[0]
        print("# llama-kv-sidecar benchmarks" + (" (--quick)" if ns.quick else ""))
        print("\n".join(info.lines()))
        print(f"load avg   {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} (1/5/15 min) at start; {rig.busy()}")
        print(
            "           CPU pressure: share of time some runnable task waited for a CPU (PSI avg10); "
            "0% is an idle machine",
            flush=True,
        )

        run = sections.Run(bed=bed, plan=p, quick=bool(ns.quick), results=results)
        for entry in sections.TABLE:
            if entry.name not in only:
                continue
            say(f"[{entry.name}] {entry.title}")
            before = rig.busy()
            value, body = entry.measure(run)
            after = rig.busy()
            raw["loads"][entry.name] = [before, after]
            show(entry.title, body, (before, after))
            if entry.result is not None:
                setattr(results, entry.result, value)
            if entry.verdicts is not None:
                own[entry.name] = entry.verdicts(value)
    finally:
        bed.close()
    load1 = rig.loadavg()
    raw.update(results.as_json())
    raw["elapsed_s"] = time.monotonic() - started
    raw["load_end"] = load1
    verdicts = goals.judge(results, quick=bool(ns.quick))
    raw["goals"] = [dataclasses.asdict(v) for v in verdicts]
    print("\n## Goals\n")
    print(goals.table(verdicts))
    print()
    print("\n".join(goals.lines(verdicts)), flush=True)
    print(
        f"\nload avg {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f} (1/5/15 min) at end, {rig.busy()}; "
        f"run took {raw['elapsed_s'] / 60:.1f} min; machine has {info.cores} cores"
    )
    json_path, png_path = out / "results.json", out / "bench.png"
    json_path.write_text(json.dumps(raw, indent=2, default=str))
    plot.write(png_path, title=_title(raw), points=results.points, samples=results.restarts, stalls=results.stalls)
    print(
        f"wrote {png_path.relative_to(REPO_ROOT) if png_path.is_relative_to(REPO_ROOT) else png_path}, "
        f"{json_path.name}; logs in {bed.log_dir.name}/"
    )
    missed = any(line.startswith("MISSED") for lines in own.values() for line in lines)
    return 1 if missed else goals.exit_code(verdicts)


def _title(raw: dict[str, Any]) -> str:
    m = raw["machine"]
    start = raw["loads"].get("start")
    load = ("" if start is None else f"{start:.1f} at start, ") + f"{raw['load_end'][0]:.1f} at end"
    return f"llama-kv-sidecar, {m['model']}, {m['cpu']} x{m['cores']}, llama-server -t {m['threads']}; load avg {load}"


def _replot(out: Path) -> int:
    raw = json.loads((out / "results.json").read_text())
    results = goals.results_from_json(raw)
    plot.write(
        out / "bench.png", title=_title(raw), points=results.points, samples=results.restarts, stalls=results.stalls
    )
    print(f"wrote {out / 'bench.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
