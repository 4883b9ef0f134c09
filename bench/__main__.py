"""`python -m bench`: run the benchmarks, print tables, write a PNG and a JSON.

Sections (all by default, or a subset with `--only`): ttft, restart, stall,
footprint, scaling, proxy, restore, hashing, library, shared, agents, hybrid, price, scale,
nodes, launcher, blocks.
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

from bench import REPO_ROOT, goals, machine, plot, rig, scaling
from bench import agents as agents_mod
from bench import footprint as footprint_mod
from bench import hashing as hashing_mod
from bench import hybrid as hybrid_mod
from bench import launcher as launcher_mod
from bench import library as library_mod
from bench import nodes as nodes_mod
from bench import price as price_mod
from bench import proxy as proxy_mod
from bench import restart as restart_mod
from bench import restore as restore_mod
from bench import scale as scale_mod
from bench import shared_blocks as blocks_mod
from bench import shared_store as shared_mod
from bench import stall as stall_mod
from bench import ttft as ttft_mod

SECTIONS = (
    "ttft", "restart", "stall", "footprint", "scaling", "proxy", "restore", "hashing", "library", "shared", "agents",
    "hybrid", "price", "scale", "nodes", "launcher", "blocks",
)  # fmt: skip


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    sizes: list[int]
    io_reps: int
    ttft_reps: int
    restart_tokens: int
    restarts: int
    stall_tokens: int
    stall_seconds: float
    stall_rounds: int
    stall_period: float
    footprint_seconds: float
    file_mib: int
    hash_reps: int
    restore_reps: int
    checksum_mib: int


def plan(ns: argparse.Namespace) -> Plan:
    quick = bool(ns.quick)
    sizes = (
        [int(s) for s in ns.sizes.split(",")]
        if ns.sizes
        else ([1024, 2048] if quick else [1024, 2048, 4096, 8192, 12288])
    )
    return Plan(
        sizes=sizes,
        io_reps=2 if quick else 5,
        ttft_reps=1 if quick else 3,
        restart_tokens=2048 if quick else 4096,
        restarts=ns.restarts or (5 if quick else 20),
        stall_tokens=2048 if quick else 4096,
        stall_seconds=15.0 if quick else 25.0,
        stall_rounds=1 if quick else 4,
        stall_period=3.5,
        footprint_seconds=6.0 if quick else 30.0,
        file_mib=128 if quick else 1024,
        hash_reps=2 if quick else 3,
        restore_reps=3 if quick else 7,
        checksum_mib=128 if quick else 256,
    )


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
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    ns = parser.parse_args(argv)
    unknown = set(ns.only.split(",")) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    return ns


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


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
    p = plan(ns)
    only = set(ns.only.split(","))
    out: Path = ns.out
    if ns.replot:
        return _replot(out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    bed = rig.Rig(log_dir=out / f"logs-{stamp}", threads=ns.threads)
    raw: dict[str, Any] = {"plan": dataclasses.asdict(p), "quick": bool(ns.quick), "loads": {}}
    results = goals.Results()
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

        def section(name: str, title: str, fn: Any) -> Any:
            if name not in only:
                return None
            say(f"[{name}] {title}")
            before = rig.busy()
            value, body = fn()
            after = rig.busy()
            raw["loads"][name] = [before, after]
            show(title, body, (before, after))
            return value

        results.points = section("ttft", "1. TTFT after kill -9: cold re-prefill vs restored", lambda: _ttft(bed, p))
        results.restarts = section(
            "restart",
            "2. Restart to restored (sidecar defaults: poll 1.0 s, 0.25 s while down)",
            lambda: _restart(bed, p),
        )
        results.stalls = section(
            "stall",
            "3. Serving stall: inter-token gaps on slot 0 while slot 1 is snapshotted",
            lambda: _stall(bed, p),
        )
        results.footprint = section("footprint", "4. Footprint: CPU share and RSS", lambda: _footprint(bed, p))
        results.rates = section(
            "scaling",
            "5. Scaling: snapshot size, save/restore, checksum vs disk",
            lambda: _scaling(bed, p, results.points),
        )
        results.proxy = section(
            "proxy",
            "6. Proxy (--proxy-listen): added latency and streamed token gaps",
            lambda: proxy_mod.measure(bed, quick=bool(ns.quick), say=say),
        )
        results.restores = section(
            "restore",
            "7. Restore path: the sidecar's restore (check + call) vs the server's own restore call",
            lambda: _restore(bed, p, quick=bool(ns.quick)),
        )
        results.checksums = section(
            "hashing",
            "8. Checksum vs disk read, and the cost of a commit",
            lambda: _hashing(bed, p),
        )
        library = section(
            "library",
            "9. Conversation library: TTFT per turn, N conversations on 2 slots, vs llama-server alone",
            lambda: library_mod.measure(bed, quick=bool(ns.quick), say=say),
        )
        section(
            "shared",
            "10. Shared store: S3 clients on an object up and down (python -m bench.shared_store)",
            lambda: shared_mod.measure(mib=64 if ns.quick else 200, reps=1 if ns.quick else 2, say=say),
        )
        results.agents = section(
            "agents",
            "11. Agents: time to the first streamed byte through the proxy, per API, vs direct",
            lambda: agents_mod.measure(bed, quick=bool(ns.quick), say=say),
        )
        results.hybrid = section(
            "hybrid",
            "12. Hybrid models: reuse and time to first token per chat turn, alone vs beside vs proxy, and kill -9",
            lambda: hybrid_mod.measure(bed, quick=bool(ns.quick), say=say),
        )
        results.price = section(
            "price",
            "13. The proxy's price per turn: warm turns, first streamed byte, CPU, and the turn after a kill -9",
            lambda: price_mod.measure(bed, quick=bool(ns.quick), say=say),
        )
        scale = section(
            "scale",
            "14. Scale: agents at an 8B-class KV, slot files whole vs the block store, and kill -9",
            lambda: scale_mod.measure(bed, quick=bool(ns.quick), say=say),
        )
        nodes = section(
            "nodes",
            "15. Nodes: two nodes behind HAProxy, the shipped config vs round robin, and a node's kill -9",
            lambda: nodes_mod.measure(bed, quick=bool(ns.quick), say=say),
        )
        launcher = section(
            "launcher",
            "16. Launcher mode after a kill -9: from the death vs beside with a restart loop, and who waits",
            lambda: launcher_mod.measure(bed, quick=bool(ns.quick), say=say),
        )
        blocks = section(
            "blocks",
            "17. Shared store: bytes moved per turn, blocks vs whole files, two nodes (python -m bench.shared_blocks)",
            lambda: blocks_mod.measure(bed, quick=bool(ns.quick), say=say),
        )
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
    missed = library is not None and any(line.startswith("MISSED") for line in library_mod.verdicts(library))
    missed |= scale is not None and any(line.startswith("MISSED") for line in scale_mod.verdicts(scale))
    missed |= nodes is not None and any(line.startswith("MISSED") for line in nodes_mod.verdicts(nodes))
    missed |= launcher is not None and any(line.startswith("MISSED") for line in launcher_mod.verdicts(launcher))
    missed |= blocks is not None and any(line.startswith("MISSED") for line in blocks_mod.verdicts(blocks))
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


def _ttft(bed: rig.Rig, p: Plan) -> tuple[list[ttft_mod.Point], str]:
    points = ttft_mod.run(bed, p.sizes, io_reps=p.io_reps, reps=p.ttft_reps, say=say)
    return points, ttft_mod.table(points)


def _restart(bed: rig.Rig, p: Plan) -> tuple[list[restart_mod.Sample], str]:
    samples, tokens = restart_mod.run(bed, tokens=p.restart_tokens, restarts=p.restarts, say=say)
    return samples, f"snapshot of {tokens:,} tokens, {len(samples)} kill -9 restarts\n\n" + restart_mod.table(samples)


def _stall(bed: rig.Rig, p: Plan) -> tuple[list[stall_mod.Condition], str]:
    conds = stall_mod.run(
        bed, base_tokens=p.stall_tokens, seconds=p.stall_seconds, rounds=p.stall_rounds, period=p.stall_period, say=say
    )
    head = (
        f"slot 1 holds ~{p.stall_tokens:,} tokens and grows every {p.stall_period} s; "
        f"{p.stall_rounds} x {p.stall_seconds:.0f} s per condition, alternating; -np 2\n\n"
    )
    direct = stall_mod.p99_ratio(conds, stall_mod.DIRECT, stall_mod.SIDECAR)
    held = stall_mod.p99_ratio(conds, stall_mod.NONE, stall_mod.HELD)
    body = stall_mod.windows_table(conds) + "\n\n" + stall_mod.table(conds)
    return conds, head + body + (
        f"\n\np99, kept rounds: sidecar (hold off) / bench's direct saves {direct:.3f}; "
        f"sidecar (defaults: hold) / no saves {held:.3f}"
    )


def _footprint(bed: rig.Rig, p: Plan) -> tuple[list[footprint_mod.State], str]:
    states = footprint_mod.run(bed, seconds=p.footprint_seconds, say=say)
    head = (
        f'{p.footprint_seconds:.0f} s per state; CPU % is of one core (100% = one core busy); "bare loop" is a '
        "Python asyncio loop that only sleeps for the poll interval, run in the same window\n\n"
    )
    return states, head + footprint_mod.table(states)


def _scaling(bed: rig.Rig, p: Plan, points: list[ttft_mod.Point] | None) -> tuple[list[scaling.Rate], str]:
    parts = []
    if points:
        parts.append(
            "per size (direct save/restore of the slot, median of "
            f"{p.io_reps}; sha256 via hashlib.file_digest, page cache warm)\n\n" + scaling.sizes_table(points)
        )
    rates = scaling.disk_and_hash(bed.work, size_mib=p.file_mib, reps=p.hash_reps)
    biggest = max((pt.io.bytes for pt in points), default=45_000_000) if points else 45_000_000
    parts.append(scaling.rates_table(rates, snapshot_bytes=biggest, file_mib=p.file_mib, reps=p.hash_reps))
    return rates, "\n\n".join(parts)


def _restore(bed: rig.Rig, p: Plan, *, quick: bool) -> tuple[list[restore_mod.Measure], str]:
    measures = restore_mod.run(bed, quick=quick, reps=p.restore_reps, say=say)
    head = (
        f"-np 1; the slot erased before each restore; {p.restore_reps} of each, alternating, medians; "
        "the sidecar's POST /restore: /slots reads + checksum + the server's restore call\n\n"
    )
    return measures, head + restore_mod.table(measures)


def _hashing(bed: rig.Rig, p: Plan) -> tuple[hashing_mod.Checksums, str]:
    found = hashing_mod.measure(bed.work, mib=p.checksum_mib, reps=p.hash_reps)
    head = (
        f"a {p.checksum_mib} MiB file in the bench's scratch dir (the slot dirs' filesystem), best of {p.hash_reps}\n\n"
    )
    return found, head + hashing_mod.report(found)


if __name__ == "__main__":
    sys.exit(main())
