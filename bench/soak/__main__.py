"""``python -m bench.soak [--minutes N] [--seed S] [--out FILE]``: see :mod:`bench.soak`.

Exit status: 0 when every invariant held, 1 when one was MISSED, 2 when a prerequisite is missing.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from bench.soak import product, runner


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # the run's clean-up runs on the way out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__)
    parser.add_argument("--minutes", type=float, default=60.0, help="length of the run (default 60)")
    parser.add_argument("--seed", type=int, default=1, help="the schedule's seed (printed with the report)")
    parser.add_argument("--out", type=Path, default=None, help="also write the figures as JSON here")
    parser.add_argument(
        "--clients",
        type=int,
        default=runner.WORKERS,
        help=f"clients sending turns at once (default {runner.WORKERS}: more than the {product.SLOTS} slots)",
    )
    ns = parser.parse_args(argv)
    if ns.minutes < 1:
        parser.error("--minutes must be at least 1: the schedule starts faults after a warm-up")
    signal.signal(signal.SIGTERM, _stop)
    if ns.clients < 1:
        parser.error("--clients must be at least 1")
    return runner.main(seed=ns.seed, minutes=ns.minutes, out=ns.out, clients=ns.clients)


if __name__ == "__main__":
    sys.exit(main())
