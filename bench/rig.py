"""What every benchmark shares: servers, sidecars, waiting, statistics, tables.

A :class:`Rig` owns the binary, the model and a scratch directory. Servers
and sidecars it makes are remembered and killed by :meth:`Rig.close`, so an
interrupted run leaves no process behind. Only one llama-server runs at a
time: a benchmark kills its server before the next one starts.
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.beds import llamabed, sidecarbed, wait

Say = Callable[[str], None]
"""Where a benchmark reports progress (stderr)."""

SIDECAR_DEFAULTS = {
    "--poll-interval": "1.0",
    "--idle-seconds": "2.0",
    "--min-tokens": "256",
    "--min-free-bytes": str(1 << 30),
}
"""The sidecar's own defaults (the test bed's are tuned for fast tests, not for realism)."""

NEXT_TURN = " Now, in one word: which of these words came first?"
"""Appended to a conversation's prompt to make its next turn."""


class BenchError(RuntimeError):
    """A benchmark could not reach the state it measures."""


class Rig:
    def __init__(self, *, log_dir: Path, threads: int = 2) -> None:
        self.binary, self.build = llamabed.llama_server_binary()
        self.model = llamabed.model_path()
        self.threads = threads
        self.log_dir = log_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="llama-kv-bench-"))
        # The sidecars' default state dir (their block store, in launcher mode or beside a tmpfs slot dir): the
        # run's own, never the caller's ~/.local/state.
        os.environ["XDG_STATE_HOME"] = str(self.work / "xdg-state")
        self._servers: list[llamabed.LlamaServer] = []
        self._sidecars: list[sidecarbed.SidecarProcess] = []

    def slot_dir(self, name: str) -> Path:
        """A fresh, empty directory for `--slot-save-path`."""
        path = self.work / name
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    def server(
        self,
        *,
        slot_dir: Path,
        n_slots: int,
        ctx_size: int,
        extra_args: Sequence[str] = (),
        model: Path | None = None,
        swa_full: bool = True,
        alone: bool = True,
    ) -> llamabed.LlamaServer:
        """Start a llama-server (killing any earlier one, unless not ``alone``) and wait until it is healthy.

        ``model``: another model file than the test model (``swa_full`` False for one without sliding windows).
        ``alone`` False: the earlier servers keep running (several nodes side by side).
        """
        for old in self._servers if alone else ():
            old.kill()
        server = llamabed.LlamaServer(
            self.binary,
            model or self.model,
            swa_full=swa_full,
            slot_dir=slot_dir,
            n_slots=n_slots,
            ctx_size=ctx_size,
            log_dir=self.log_dir,
            threads=self.threads,
            extra_args=list(extra_args),
        )
        self._servers.append(server)
        server.start()
        server.wait_healthy(timeout=300)
        return server

    def sidecar(self, server: llamabed.LlamaServer, slot_dir: Path, **options: str) -> sidecarbed.SidecarProcess:
        """Start `python -m sidecar run` with the sidecar's defaults, overridden by `options`."""
        return self.sidecar_with(server, slot_dir, options)

    def sidecar_with(
        self, server: llamabed.LlamaServer, slot_dir: Path, options: dict[str, str], env: dict[str, str] | None = None
    ) -> sidecarbed.SidecarProcess:
        """:meth:`sidecar`, with `env` added to its environment."""
        n = len(self._sidecars)
        side = sidecarbed.SidecarProcess(
            server.url, slot_dir, self.log_dir / f"sidecar-{n:02d}.log", extra={**SIDECAR_DEFAULTS, **options}, env=env
        )
        self._sidecars.append(side)
        side.start()
        return side

    def close(self) -> None:
        for side in self._sidecars:
            side.kill()
        for server in self._servers:
            server.kill()
        shutil.rmtree(self.work, ignore_errors=True)


def clear_dir(path: Path) -> None:
    for entry in path.iterdir():
        if entry.is_file():
            entry.unlink()


def wait_idle(url: str, *, timeout: float = 120.0) -> None:
    """Wait until no slot of the server is processing."""
    wait.wait_until(
        lambda: not any(s.get("is_processing") for s in llamabed.slots(url)),
        timeout=timeout,
        what="idle slots",
        every=0.1,
    )


def snapshot_of(side: sidecarbed.SidecarProcess, slot: int, min_tokens: int) -> dict[str, Any] | None:
    """The newest `snapshot_committed` log line of `slot` holding at least `min_tokens`."""
    found: list[dict[str, Any]] = side.log_events("snapshot_committed")
    matches = [e for e in found if e.get("slot") == slot and int(e.get("tokens", 0)) >= min_tokens]
    return matches[-1] if matches else None


log_time = sidecarbed.log_time
"""Unix time of a sidecar JSON log line."""


def loadavg() -> tuple[float, float, float]:
    one, five, fifteen = Path("/proc/loadavg").read_text().split()[:3]
    return float(one), float(five), float(fifteen)


def cpu_pressure() -> float | None:
    """Share of the last 10 s in which some runnable task waited for a CPU (PSI), 0-100; None if unavailable."""
    try:
        first = Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    fields = dict(part.split("=", 1) for part in first.split()[1:])
    return float(fields.get("avg10", "nan"))


def busy() -> str:
    """The machine's load now, for section headers."""
    one = loadavg()[0]
    psi = cpu_pressure()
    return f"load {one:.2f}" + ("" if psi is None else f", CPU pressure {psi:.0f}%")


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in 0..100 (nan for no values)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def spread(values: Sequence[float]) -> float:
    """Largest minus smallest of a figure measured once per round; nan with fewer than two rounds."""
    good = [v for v in values if not math.isnan(v)]
    return max(good) - min(good) if len(good) >= 2 else math.nan


def decide(value: float, bar: float, *, rounds: Sequence[float], quick: bool, at_most: bool = True) -> bool | None:
    """Whether ``value`` meets ``bar`` (at most it, or at least it); None, no verdict, when it cannot tell.

    A quick run cannot tell when its rounds' figures (``rounds``: the same figure, once per round, or per
    half of a single round) differ by as much as the margin between ``value`` and ``bar``, or when there
    are fewer than two of them: another quick run could land on the other side. A full run always decides.
    """
    if math.isnan(value):
        return None
    if quick and not spread(rounds) < abs(bar - value):
        return None
    return value <= bar if at_most else value >= bar


def word(met: bool | None) -> str:
    """A verdict's word: MET, MISSED, or NO VERDICT (None)."""
    return {True: "MET", False: "MISSED", None: "NO VERDICT"}[met]


def halves(values: Sequence[float]) -> tuple[Sequence[float], Sequence[float]]:
    """The first and the second half of a series, in the order measured: two rounds made of one."""
    mid = len(values) // 2
    return values[:mid], values[mid:]


def fmt(value: object, digits: int = 3) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], digits: int = 3, *, left: bool = False) -> str:
    """A plain-text table; numbers right-aligned unless `left`."""
    cells = [[fmt(c, digits) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    numeric = [not left and all(_numeric(row[i]) for row in rows) for i in range(len(headers))]

    def line(items: Sequence[str]) -> str:
        return "  ".join(s.rjust(w) if num else s.ljust(w) for s, w, num in zip(items, widths, numeric, strict=True))

    rule = "  ".join("-" * w for w in widths)
    return "\n".join(row.rstrip() for row in [line(headers), rule, *(line(r) for r in cells)])


def _numeric(value: object) -> bool:
    return isinstance(value, int | float) or (isinstance(value, str) and value[:1] in tuple("0123456789-+."))


def cpu_ticks(pid: int) -> int:
    """utime + stime of a process (all its threads), in clock ticks."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5), counted from state


def cpu_seconds(pid: int) -> float:
    """On-CPU time of all threads of a process, from the scheduler (`schedstat`, ns), else from `stat` ticks.

    The scheduler's figure is exact; `stat` counts whole 10 ms ticks, which misstates short periodic wake-ups.
    """
    try:
        total = 0
        for tid in os.listdir(f"/proc/{pid}/task"):
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return cpu_ticks(pid) / CLK_TCK
    return total / 1e9


def rss_bytes(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process in bytes."""
    found = {"VmRSS": 0, "VmHWM": 0}
    for row in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = row.partition(":")
        if key in found:
            found[key] = int(rest.split()[0]) * 1024
    return found["VmRSS"], found["VmHWM"]


CLK_TCK = os.sysconf("SC_CLK_TCK")
