"""Checksum and commit costs: which hash, and fsync or fdatasync, on this machine's disk.

    python -m bench.hashing [--mib 200] [--reps 3] [--dir DIR]

DIR defaults to a temporary directory; point it at the slot dir's filesystem
to measure that disk. Prints three tables:

* hash throughput over memory (the CPU bound) and over a file in the page
  cache, for sha256 (manifest format 1), xxh3-128 (format 2) and BLAKE3
  (single-threaded and on every core), each as a ratio to the disk's read;
* the disk's sequential read, O_DIRECT and buffered from a cold cache;
* a commit as the sidecar does it right after llama-server wrote the file
  (its pages dirty in the page cache): the previous one (sha256 + fsync)
  and the current one (xxh3-128 + fdatasync, ``hashing.digest_and_sync``),
  with variants: wall time (what the save waits for) and CPU time (what
  competes with generation on the same cores), as ratios to the current one.

Each figure is the best of ``--reps`` runs.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import blake3
import xxhash

from bench import diskread
from sidecar.core import hashing

CHUNK = hashing.CHUNK


def _timed(work: Callable[[], object]) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def _write(path: Path, block: bytes, mib: int) -> None:
    """What llama-server does on a save: plain writes, no sync."""
    with path.open("wb") as fh:
        for _ in range(max(1, mib // (len(block) >> 20))):
            fh.write(block)


def _blake3_file(path: Path, threads: int) -> str:
    hasher = blake3.blake3(max_threads=threads)
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with path.open("rb", buffering=0) as fh:
        while got := fh.readinto(buf):
            hasher.update(view[:got])
    return hasher.hexdigest()


def _commit_previous(path: Path) -> None:
    """The commit of manifest format 1: sha256 through hashlib.file_digest, then fsync."""
    with path.open("rb+") as fh:
        hashlib.file_digest(fh, "sha256")
        os.fsync(fh.fileno())


def _commit_xxh3_fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        hashing.fd_digest(fd, hashing.Algorithm.XXH3_128)  # the same read loop, another sync
        os.fsync(fd)
    finally:
        os.close(fd)


def _commit_overlapped(path: Path) -> None:
    """fdatasync in a second thread while the hash reads the cached pages: both done before the rename."""
    fd = os.open(path, os.O_RDONLY)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            synced = pool.submit(os.fdatasync, fd)
            hashing.fd_digest(fd, hashing.Algorithm.XXH3_128)
            synced.result()
    finally:
        os.close(fd)


def _commit_dropping_cache(path: Path) -> None:
    hashing.digest_and_sync(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(out)


@dataclasses.dataclass(frozen=True, slots=True)
class Checksums:
    """One run of :func:`measure`; throughputs in MB/s, times in seconds."""

    mb: float
    """Size of the file hashed and read."""
    memory: dict[str, float]
    """Hash over memory (the CPU bound), per hash."""
    cached: dict[str, float]
    """Hash of the file from the page cache, per hash."""
    direct: float
    """Sequential read with O_DIRECT (nan when refused)."""
    direct_note: str
    cold: float
    """Buffered read after evicting the file."""
    commits: dict[str, tuple[float, float]]
    """(wall, CPU) of each way to commit a file just written."""

    @property
    def current(self) -> float:
        """The sidecar's checksum (xxh3-128) of a file in the page cache over the disk's O_DIRECT read."""
        return self.cached[ALGORITHM] / self.direct


def measure(work: Path, *, mib: int, reps: int) -> Checksums:
    block = os.urandom(16 << 20)
    path = work / "bench-hashing.bin"
    _write(path, block, mib)
    size = path.stat().st_size
    mb = size / 1e6
    try:
        memory = block * max(1, mib // 16)
        cpu: dict[str, Callable[[], object]] = {
            "sha256": lambda: hashlib.sha256(memory).digest(),
            "xxh3-128": lambda: xxhash.xxh3_128(memory).digest(),
            "blake3, 1 thread": lambda: blake3.blake3(memory).digest(),
            "blake3, all cores": lambda: blake3.blake3(memory, max_threads=blake3.blake3.AUTO).digest(),
        }
        files: dict[str, Callable[[], object]] = {
            "sha256": lambda: hashing.file_digest(path, hashing.Algorithm.SHA256),
            "xxh3-128": lambda: hashing.file_digest(path, hashing.Algorithm.XXH3_128),
            "blake3, 1 thread": lambda: _blake3_file(path, 1),
            "blake3, all cores": lambda: _blake3_file(path, blake3.blake3.AUTO),
        }
        try:
            direct = mb / diskread.best(lambda: diskread.read_direct(path), reps)
            direct_note = ""
        except OSError as exc:
            direct, direct_note = float("nan"), f"O_DIRECT refused: {exc}"
        cold = mb / diskread.best(lambda: diskread.read_cold(path), reps)
        files["xxh3-128"]()  # warm the page cache again
        in_memory = {
            name: len(memory) / 1e6 / diskread.best(functools.partial(_timed, fn), reps) for name, fn in cpu.items()
        }
        cached = {name: mb / diskread.best(functools.partial(_timed, fn), reps) for name, fn in files.items()}

        def commit(how: Callable[[Path], object]) -> tuple[float, float]:
            """Best wall time and best CPU time (all threads of this process) of a commit."""
            walls, cpus = [], []
            for _ in range(reps):
                _write(path, block, mib)  # fresh dirty pages, as right after the server's save
                cpu_started = time.process_time()
                walls.append(_timed(lambda: how(path)))
                cpus.append(time.process_time() - cpu_started)
            return min(walls), min(cpus)

        commits = {
            PREVIOUS_COMMIT: commit(_commit_previous),
            "xxh3-128 + fsync": commit(_commit_xxh3_fsync),
            CURRENT_COMMIT: commit(hashing.digest_and_sync),
            "xxh3-128 + fdatasync + fadvise(DONTNEED)": commit(_commit_dropping_cache),
            "xxh3-128 while fdatasync runs in a thread": commit(_commit_overlapped),
        }
    finally:
        path.unlink(missing_ok=True)
    return Checksums(mb, in_memory, cached, direct, direct_note, cold, commits)


PREVIOUS_COMMIT = "previous: sha256 + fsync"
CURRENT_COMMIT = "current: xxh3-128 + fdatasync"
ALGORITHM = str(hashing.CURRENT)
"""The sidecar's checksum of new snapshots."""


def report(c: Checksums) -> str:
    """The three tables: hashes, disk reads, commits."""
    rows = [
        [name, f"{c.memory[name]:,.0f}", f"{c.cached[name]:,.0f}", f"{c.cached[name] / c.direct:.2f}x"]
        for name in c.memory
    ]
    hashes = _table(["hash", "MB/s memory", "MB/s file, page cache", "vs O_DIRECT read"], rows)
    reads = _table(
        ["disk read", "MB/s", ""],
        [
            ["sequential, O_DIRECT, 8 MiB", f"{c.direct:,.0f}", c.direct_note],
            ["sequential, buffered, cache dropped", f"{c.cold:,.0f}", ""],
        ],
    )
    wall_now, cpu_now = c.commits[CURRENT_COMMIT]
    commit_rows = [
        [name, f"{wall * 1000:,.0f}", f"{wall / wall_now:.2f}x", f"{cpu * 1000:,.0f}", f"{cpu / cpu_now:.2f}x"]
        for name, (wall, cpu) in c.commits.items()
    ]
    commit_table = _table(
        [f"commit of a {c.mb:.0f} MB file just written", "wall ms", "vs current", "CPU ms", "vs current"],
        commit_rows,
    )
    return f"{hashes}\n\n{reads}\n\n{commit_table}\n"


def run(work: Path, *, mib: int, reps: int) -> str:
    return report(measure(work, mib=mib, reps=reps))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.hashing", description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=200, help="file size in MiB (default 200)")
    parser.add_argument("--reps", type=int, default=3, help="runs per figure, best kept (default 3)")
    parser.add_argument("--dir", type=Path, default=None, help="where the file goes (default: a temp dir)")
    ns = parser.parse_args(argv)
    with contextlib.ExitStack() as stack:
        work = ns.dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-hashing-")))
        print(f"{ns.mib} MiB file in {work}, best of {ns.reps}\n")
        print(run(work, mib=ns.mib, reps=ns.reps))


if __name__ == "__main__":
    main()
