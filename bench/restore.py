"""The restore path: the sidecar's restore against the server's own restore call of the same file.

Per setup, one llama-server (`-np 1`) holds a conversation and a sidecar
(`--admin-token`) saves it as a snapshot. Then, `reps` times:

* **after a restart**: the server is killed (SIGKILL) and, once the sidecar
  has seen it down, started again; the sidecar checks the snapshot (size, checksum) while the server loads
  (`snapshots_prechecked`) and restores it once the server is healthy. Its
  `slot_restored` log line gives `path_seconds`: from its read of the slot
  to the end of the restore call (what stands between a healthy server and
  the slot holding the KV, with the check made ahead); and `seconds`, the
  call alone. Then the same with the sidecar stopped (SIGSTOP): the bench
  restores the same `.bin` itself (`POST /slots/0?action=restore`) right
  after the restart (the first restore into a new process is slower: its KV
  buffer is touched for the first time): wall time and `restore_ms`;
* **server call**: with the slot erased (`POST /slots/0?action=erase`), the
  bench restores the file into the running server: wall time and the
  server's `restore_ms`;
* **on demand**: with the slot erased, `POST /restore` to the sidecar: no
  check was made ahead, so it hashes the file in the round (the file is in
  the page cache, as for the server call), then reads the slot, calls and
  reads again. Shown beside, no goal: each restore round hashes its files
  anew unless they were checked while the server loaded.

Setups: today's snapshot (f16 KV, 4K tokens; 2K quick) and a large one (f32
KV, `--cache-type-k f32 --cache-type-v f32`, grown until the file holds at
least `LARGE_BYTES`). The large conversation's prefill takes minutes on 2
cores, so its file is made once and kept in the cache directory
(`~/.cache/llama-kv-sidecar/bench/`, keyed by build, model and KV type);
later runs restore it into a fresh server instead of prefilling again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from bench import rig
from bench.beds import llamabed, sidecarbed, wait

LARGE_BYTES = 200_000_000
"""The large setup's snapshot holds at least this many bytes."""
ADMIN_TOKEN = "bench-restore-token"
GROW_LIMIT = 65536
"""Context of the server that grows the large conversation."""
STEP = 8192
"""Most tokens a growing turn adds."""
SEED_FILE = "bench-restore-seed.bin"
"""The conversation as the bench saved it, before the sidecar's own snapshot of it."""


@dataclasses.dataclass(frozen=True, slots=True)
class Setup:
    name: str
    cache_type: str
    tokens: int
    """Prompt tokens; for a setup with `min_bytes`, where the growth starts."""
    min_bytes: int = 0
    """Grow the conversation until its snapshot holds this many bytes (0: `tokens` as given)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Measure:
    name: str
    tokens: int
    bytes: int
    direct_ms: list[float]
    """Wall time of the bench's own restore call."""
    direct_server_ms: list[float]
    """The server's `restore_ms` for those calls."""
    restart_direct_ms: list[float]
    """After a restart, the sidecar stopped: wall time of the bench's own restore call."""
    restart_direct_server_ms: list[float]
    restart_ms: list[float]
    """After a restart: the sidecar's `path_seconds` (slot read to the call's end; checked ahead)."""
    restart_call_ms: list[float]
    """After a restart: the sidecar's restore call alone (`seconds`)."""
    precheck_ms: list[float]
    """After a restart: the sidecar's check while the server loaded (`snapshots_prechecked`)."""
    demand_ms: list[float]
    """On demand (`POST /restore`): `path_seconds`, the check included."""
    demand_wall_ms: list[float]
    """On demand: wall time of `POST /restore` as the bench saw it."""
    made_s: float
    """Seconds to make the conversation (prefill; or restore from the cache)."""
    cached: bool

    @property
    def ratio(self) -> float:
        """The sidecar's restore after a restart over the server's own call after a restart (medians)."""
        return rig.median(self.restart_ms) / rig.median(self.restart_direct_ms)

    @property
    def own_ratio(self) -> float:
        """After a restart: the sidecar's slot read + call over its call alone (medians of each restore's ratio)."""
        return rig.median([p / c for p, c in zip(self.restart_ms, self.restart_call_ms, strict=True)])

    @property
    def demand_ratio(self) -> float:
        """The sidecar's restore on demand (check included) over the server's own call (medians)."""
        return rig.median(self.demand_ms) / rig.median(self.direct_ms)


def setups(*, quick: bool) -> list[Setup]:
    return [
        Setup("today: f16 KV", "f16", 2048 if quick else 4096),
        Setup(f"large: f32 KV, >= {LARGE_BYTES / 1e6:.0f} MB", "f32", 4096, min_bytes=LARGE_BYTES),
    ]


def _cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "llama-kv-sidecar" / "bench"


def _server(bed: rig.Rig, slot_dir: Path, setup: Setup, ctx: int) -> llamabed.LlamaServer:
    kv = ["--cache-type-k", setup.cache_type, "--cache-type-v", setup.cache_type]
    return bed.server(slot_dir=slot_dir, n_slots=1, ctx_size=ctx, extra_args=kv)


def _save_size(server: llamabed.LlamaServer, slot_dir: Path) -> int:
    llamabed.slot_action(server.url, 0, "save", SEED_FILE)
    return (slot_dir / SEED_FILE).stat().st_size


def _grow(bed: rig.Rig, slot_dir: Path, setup: Setup, say: rig.Say) -> tuple[llamabed.LlamaServer, int, str]:
    """Prefill a conversation until its snapshot holds `setup.min_bytes`; returns the server, tokens, prompt.

    Two short turns give the size per token; the conversation then grows towards the estimate by
    at most `STEP` tokens a turn (each prompt shares its prefix with the turn before, so only the
    new part is prefilled, and no request runs for many minutes).
    """
    limit = GROW_LIMIT
    server = _server(bed, slot_dir, setup, limit)
    probe = llamabed.make_prompt(server.url, limit - 1024, seed=41)
    words = probe.split(" ")

    texts: list[str] = []

    def turn(share: float) -> tuple[int, int]:
        texts.append(" ".join(words[: max(16, int(len(words) * share))]))
        answer = llamabed.complete(server.url, texts[-1], n_predict=1, id_slot=0)
        return int(answer["tokens_evaluated"]), _save_size(server, slot_dir)

    t1, b1 = turn(setup.tokens / limit)
    t2, b2 = turn(2 * setup.tokens / limit)
    per_token = (b2 - b1) / max(1, t2 - t1)
    share = 2 * setup.tokens / limit
    tokens, size = t2, b2
    while size < setup.min_bytes:
        want = min(t2 + (setup.min_bytes * 1.02 - b2) / per_token, tokens + STEP)
        share = min(1.0, max(share * 1.05, share * want / max(1, tokens)))
        started = time.monotonic()
        tokens, size = turn(share)
        say(f"  {setup.name}: {tokens:,} tokens, {size / 1e6:.0f} MB ({time.monotonic() - started:.0f} s)")
        if share >= 1.0 and size < setup.min_bytes:
            raise rig.BenchError(f"{limit} tokens give only {size:,} bytes, below {setup.min_bytes:,}")
    return server, tokens, texts[-1]


def _prompt_of(url: str, tokens: int) -> str:
    """The prefix of `_grow`'s text that holds `tokens` tokens (for a cached file made without its prompt)."""
    words = llamabed.make_prompt(url, GROW_LIMIT - 1024, seed=41).split(" ")
    lo, hi = 16, len(words)
    while lo < hi:  # the fewest words whose text holds at least `tokens` tokens (BOS counted)
        mid = (lo + hi) // 2
        if len(llamabed.tokenize(url, " ".join(words[:mid]))) + 1 >= tokens:
            hi = mid
        else:
            lo = mid + 1
    return " ".join(words[:lo])


def _make(bed: rig.Rig, slot_dir: Path, setup: Setup, say: rig.Say) -> tuple[llamabed.LlamaServer, int, bool]:
    """A server whose slot 0 holds the setup's conversation; (server, tokens, taken from the cache)."""
    if not setup.min_bytes:
        server = _server(bed, slot_dir, setup, max(4096, setup.tokens * 2))
        prompt = llamabed.make_prompt(server.url, setup.tokens, seed=43)
        answer = llamabed.complete(server.url, prompt, n_predict=1, id_slot=0)
        return server, int(answer["tokens_evaluated"]), False
    key = f"{bed.build.split(',')[0]}-{bed.model.stem}-{setup.cache_type}-{setup.min_bytes // 1_000_000}MB"
    cached, meta = _cache_dir() / f"{key}.bin", _cache_dir() / f"{key}.json"
    if cached.exists() and meta.exists():
        known = json.loads(meta.read_text())
        tokens = int(known["tokens"])
        server = _server(bed, slot_dir, setup, tokens + 1024)
        shutil.copyfile(cached, slot_dir / SEED_FILE)
        try:
            done = llamabed.slot_action(server.url, 0, "restore", SEED_FILE)
        except llamabed.LlamaHTTPError as exc:
            say(f"  {setup.name}: the cached conversation did not restore ({exc}); making it again")
        else:
            if int(done["n_restored"]) >= tokens:
                # A restore is no task: /slots shows the slot empty until one runs. The conversation's
                # own prompt runs on the restored KV (cache_n about all of it) and the sidecar sees it.
                prompt = str(known.get("prompt") or _prompt_of(server.url, tokens))
                meta.write_text(json.dumps({**known, "prompt": prompt}))
                answer = llamabed.complete(server.url, prompt, n_predict=1, id_slot=0)
                return server, int(answer["tokens_evaluated"]), True
    server, tokens, prompt = _grow(bed, slot_dir, setup, say)
    cached.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(slot_dir / SEED_FILE, cached)
    meta.write_text(json.dumps({"tokens": tokens, "bytes": cached.stat().st_size, "prompt": prompt}))
    return server, tokens, False


def _snapshot(side: sidecarbed.SidecarProcess) -> str | None:
    """Have the sidecar save slot 0 and return its file; None until it has seen the slot hold tokens (400)."""
    status, body = side.request("POST", "/snapshot?slot=0", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    if status == 400:
        return None
    if status != 200:
        raise rig.BenchError(f"the sidecar's snapshot answered HTTP {status}: {body[:300]}")
    return str(json.loads(body)["result"]["detail"])


def _direct(url: str, file: str) -> tuple[float, float]:
    started = time.perf_counter()
    answer = llamabed.slot_action(url, 0, "restore", file)
    return (time.perf_counter() - started) * 1000, float(answer["timings"]["restore_ms"])


def _on_demand(side: sidecarbed.SidecarProcess) -> tuple[float, float]:
    """(wall ms of POST /restore, the sidecar's path ms) of a restore asked of the sidecar."""
    seen = len(side.log_events("slot_restored"))
    started = time.perf_counter()
    status, body = side.request("POST", "/restore", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    wall = (time.perf_counter() - started) * 1000
    results: list[dict[str, Any]] = json.loads(body)["results"] if status == 200 else []
    if status != 200 or [r["result"] for r in results] != ["ok"]:
        raise rig.BenchError(f"the sidecar's restore answered HTTP {status}: {body[:300]}")
    entry = side.wait_for(lambda: _nth(side, "slot_restored", seen), timeout=30, what="slot_restored")
    assert entry is not None
    return wall, float(entry["path_seconds"]) * 1000


def _after_restart(server: llamabed.LlamaServer, side: sidecarbed.SidecarProcess) -> tuple[float, float, float]:
    """Kill -9 and start the server; (path ms, call ms, precheck ms) of the sidecar's restore."""
    seen = len(side.log_events("slot_restored"))
    checks = len(side.log_events("snapshots_prechecked"))
    down = len(side.log_events("server_unreachable"))
    server.kill()
    # Start it again once the sidecar has seen it down, as after a crash: it checks the files while
    # the server loads. (A restart between two polls leaves the check to the round: section 2 has those.)
    side.wait_for(lambda: len(side.log_events("server_unreachable")) > down, timeout=30, what="server_unreachable")
    server.start()
    server.wait_healthy(timeout=300)
    entry = side.wait_for(lambda: _nth(side, "slot_restored", seen), timeout=120, what="slot_restored")
    assert entry is not None
    check = _nth(side, "snapshots_prechecked", checks)
    precheck = float(check["seconds"]) * 1000 if check is not None else float("nan")
    return float(entry["path_seconds"]) * 1000, float(entry["seconds"]) * 1000, precheck


def _nth(side: sidecarbed.SidecarProcess, event: str, n: int) -> dict[str, Any] | None:
    found: list[dict[str, Any]] = side.log_events(event)
    return found[n] if len(found) > n else None


def measure(bed: rig.Rig, setup: Setup, *, reps: int, say: rig.Say) -> Measure:
    slot_dir = bed.slot_dir("restore")
    started = time.monotonic()
    server, tokens, cached = _make(bed, slot_dir, setup, say)
    made = time.monotonic() - started
    (slot_dir / SEED_FILE).unlink(missing_ok=True)
    side = bed.sidecar(
        server,
        slot_dir,
        **{"--admin-token": ADMIN_TOKEN, "--idle-seconds": "3600", "--snapshot-interval": "3600"},
    )
    file = side.wait_for(lambda: _snapshot(side), timeout=300, what="the sidecar's snapshot of slot 0")
    assert file is not None
    size = (slot_dir / file).stat().st_size
    m = Measure(setup.name, tokens, size, [], [], [], [], [], [], [], [], [], made, cached)
    for i in range(reps):
        path, call, precheck = _after_restart(server, side)
        m.restart_ms.append(path)
        m.restart_call_ms.append(call)
        m.precheck_ms.append(precheck)
        side.pause()
        seen = len(side.log_events("slot_restored"))
        try:
            server.kill()
            server.start()
            server.wait_healthy(timeout=300)
            wall, server_ms = _direct(server.url, file)
        finally:
            side.resume()
        # A restore is no task: /slots shows the slot empty, so the sidecar restores it once more.
        # Let that round end before the next call, which it would otherwise delay.
        with contextlib.suppress(wait.TimedOut):
            side.wait_for(functools.partial(_nth, side, "slot_restored", seen), timeout=20, what="its restore")
        m.restart_direct_ms.append(wall)
        m.restart_direct_server_ms.append(server_ms)
        for way in ("direct", "demand") if i % 2 == 0 else ("demand", "direct"):
            llamabed.slot_action(server.url, 0, "erase")
            if way == "direct":
                wall, server_ms = _direct(server.url, file)
                m.direct_ms.append(wall)
                m.direct_server_ms.append(server_ms)
            else:
                wall, path = _on_demand(side)
                m.demand_wall_ms.append(wall)
                m.demand_ms.append(path)
    side.kill()
    server.kill()
    say(f"  {setup.name}: {size / 1e6:.0f} MB, sidecar {m.ratio:.2f}x the server's own call after a restart")
    return m


def run(bed: rig.Rig, *, quick: bool, reps: int, say: rig.Say) -> list[Measure]:
    return [measure(bed, s, reps=reps, say=say) for s in setups(quick=quick)]


def table(measures: list[Measure]) -> str:
    rows = [
        [
            m.name,
            m.tokens,
            m.bytes / 1e6,
            rig.median(m.restart_direct_ms),
            rig.median(m.restart_direct_server_ms),
            rig.median(m.precheck_ms),
            rig.median(m.restart_ms),
            rig.median(m.restart_call_ms),
            f"{m.ratio:.2f}x",
            f"{m.own_ratio:.2f}x",
            rig.median(m.direct_ms),
            rig.median(m.direct_server_ms),
            rig.median(m.demand_ms),
            rig.median(m.demand_wall_ms),
            f"{m.demand_ratio:.2f}x",
            f"{m.made_s:.0f}" + (" (cached file)" if m.cached else ""),
        ]
        for m in measures
    ]
    headers = [
        "setup",
        "tokens",
        "MB",
        "restart: server call ms",
        "restore_ms",
        "sidecar: check while loading ms",
        "slot read + call ms",
        "  its call ms",
        "vs server call",
        "vs its call",
        "running: server call ms",
        "restore_ms",
        "sidecar on demand ms",
        "  POST /restore ms",
        "vs server call",
        "made in s",
    ]
    return rig.table(headers, rows, digits=1)
