"""How snapshots grow with tokens, and whether the checksum keeps up with the disk.

Per size (from the TTFT run's direct save/restore of the slot): bytes on
disk, bytes per token, the server's `save_ms`/`restore_ms` and the client's
wall time, per 1K tokens, and the sha256 of the file as the sidecar computes
it (`hashlib.file_digest`, page cache warm, as it is right after a save).

Then the sidecar's checksum against the disk, on a scratch file in the same
filesystem as the slot dir: sha256 over memory (the CPU bound), over the
file from the page cache and after evicting it (`posix_fadvise(DONTNEED)`),
and the disk's sequential read with `O_DIRECT` (8 MiB reads into an aligned
buffer). On a virtual machine "the disk" may itself be cached by the host.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from pathlib import Path

from bench import diskread, rig, ttft


@dataclasses.dataclass(frozen=True, slots=True)
class Rate:
    name: str
    gb_per_s: float
    note: str = ""


def sizes_table(points: list[ttft.Point]) -> str:
    rows = []
    for p in points:
        io = p.io
        k = io.tokens / 1000
        rows.append(
            [
                io.tokens,
                io.bytes / 1e6,
                f"{io.bytes / max(io.tokens, 1):,.0f}",
                rig.median(io.save_ms),
                rig.median(io.save_wall_ms),
                rig.median(io.restore_ms),
                rig.median(io.restore_wall_ms),
                rig.median(io.save_ms) / k,
                rig.median(io.restore_ms) / k,
                rig.median(io.sha256_ms),
                io.bytes / 1e6 / (rig.median(io.sha256_ms) / 1000),
            ]
        )
    headers = [
        "tokens",
        "MB",
        "bytes/token",
        "save_ms",
        "save wall ms",
        "restore_ms",
        "restore wall ms",
        "save ms/1K tok",
        "restore ms/1K tok",
        "sha256 ms",
        "sha256 MB/s",
    ]
    text = rig.table(headers, rows, digits=1)
    fit = size_fit(points)
    if fit is not None:
        fixed, per_token = fit
        text += (
            f"\n\nsize = {fixed / 1e6:.1f} MB + {per_token:,.0f} bytes/token (least squares): a fixed part "
            "(buffers saved whatever the token count) plus a per-token part"
        )
    return text


def size_fit(points: list[ttft.Point]) -> tuple[float, float] | None:
    """(fixed bytes, bytes per token) of snapshot size by least squares; None below two sizes."""
    xs = [float(p.io.tokens) for p in points]
    ys = [float(p.io.bytes) for p in points]
    if len(set(xs)) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def _digest(path: Path) -> float:
    started = time.perf_counter()
    with path.open("rb") as fh:
        hashlib.file_digest(fh, "sha256")
    return time.perf_counter() - started


def _digest_cold(path: Path) -> float:
    diskread.evict(path)
    return _digest(path)


def disk_and_hash(work: Path, *, size_mib: int, reps: int) -> list[Rate]:
    path = work / "bench-read.bin"
    block = os.urandom(16 << 20)
    with path.open("wb") as fh:
        for _ in range(max(1, size_mib // 16)):
            fh.write(block)
        fh.flush()
        os.fsync(fh.fileno())
    size = path.stat().st_size
    gb = size / 1e9
    try:
        mem = block * 4

        def in_memory() -> float:
            started = time.perf_counter()
            hashlib.sha256(mem).digest()
            return time.perf_counter() - started

        rates = [Rate("sha256 over memory (CPU bound)", len(mem) / 1e9 / diskread.best(in_memory, reps))]
        _digest(path)  # warm the page cache
        rates.append(Rate("file_digest sha256, page cache warm", gb / diskread.best(lambda: _digest(path), reps)))
        rates.append(
            Rate("file_digest sha256, after fadvise(DONTNEED)", gb / diskread.best(lambda: _digest_cold(path), reps))
        )
        try:
            rates.append(
                Rate("sequential read, O_DIRECT, 8 MiB", gb / diskread.best(lambda: diskread.read_direct(path), reps))
            )
        except OSError as exc:
            rates.append(Rate("sequential read, O_DIRECT, 8 MiB", float("nan"), f"O_DIRECT refused: {exc}"))
        rates.append(
            Rate(
                "sequential read, buffered, after fadvise(DONTNEED)",
                gb / diskread.best(lambda: diskread.read_cold(path), reps),
            )
        )
        rates.append(
            Rate("sequential read, page cache warm", gb / diskread.best(lambda: diskread.read_warm(path), reps))
        )
    finally:
        path.unlink(missing_ok=True)
    return rates


def rates_table(rates: list[Rate], *, snapshot_bytes: int, file_mib: int, reps: int) -> str:
    mb = snapshot_bytes / 1e6
    rows = [[r.name, r.gb_per_s, mb / r.gb_per_s if r.gb_per_s > 0 else float("nan"), r.note] for r in rates]
    headers = [f"over a {file_mib} MiB file (best of {reps})", "GB/s", f"ms for a {mb:.0f} MB snapshot", ""]
    return rig.table(headers, rows, digits=2)
