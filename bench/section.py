"""One benchmark section run on its own, ``python -m bench.<name>``: flags, rig, table, exit code."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

from bench import REPO_ROOT, rig

Result = TypeVar("Result")
Result_co = TypeVar("Result_co", covariant=True)


class Measure(Protocol[Result_co]):
    """A section's measurement: its result and the table printed for it."""

    def __call__(self, bed: rig.Rig, *, quick: bool, say: rig.Say) -> tuple[Result_co, str]: ...


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def main(
    argv: list[str] | None,
    *,
    name: str,
    doc: str | None,
    title: str,
    quick_help: str,
    measure: Measure[Result],
    missed: Callable[[Result, bool], bool],
) -> int:
    """Run one section; exit status 1 when ``missed(result, quick)`` says a goal was missed."""
    parser = argparse.ArgumentParser(prog=f"python -m bench.{name}", description=(doc or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "out", help="logs go here")
    parser.add_argument("--threads", type=int, default=2, help="llama-server -t (default 2)")
    ns = parser.parse_args(argv)
    bed = rig.Rig(log_dir=ns.out / f"logs-{name}-{time.strftime('%Y%m%d-%H%M%S')}", threads=ns.threads)
    try:
        before = rig.busy()
        result, body = measure(bed, quick=ns.quick, say=_say)
        print(f"## {title}\n({before} at start, {rig.busy()} at end)\n")
        print(body)
    finally:
        bed.close()
    return 1 if missed(result, ns.quick) else 0
