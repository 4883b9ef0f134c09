"""From a restarted server being healthy to its slot being restored.

One conversation is saved by a sidecar with default settings, then the
server is killed (SIGKILL) and started again N times. For each restart:

* the bench polls `/health` every 10 ms and notes when the server first
  answers 200 (*healthy*);
* the sidecar logs `slot_restored` with `since_healthy` (from the poll on
  which *it* first saw the server healthy to the restore call returning),
  `path_seconds` (slot read + restore call; the file was checked while the
  server loaded) and `server_ms` (the server's own
  `restore_ms`).

From these: *detection* = healthy (bench) to healthy (sidecar), i.e. poll
phase; *overhead* = healthy (bench) to restored (sidecar log time) minus
`server_ms`: everything the sidecar adds to the server's own restore.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import time
from typing import Any

from bench import rig
from bench.beds import llamabed, sidecarbed, wait


@dataclasses.dataclass(frozen=True, slots=True)
class Sample:
    load_s: float
    """kill -9 + start to healthy (bench)."""
    healthy_to_restored_s: float
    """Healthy (bench) to the `slot_restored` log line."""
    since_healthy_s: float
    """The sidecar's own `since_healthy`."""
    call_s: float
    """The sidecar's `path_seconds`: slot read + restore call (the check ran while the server loaded)."""
    server_ms: float
    """The server's `restore_ms`."""

    @property
    def detection_s(self) -> float:
        return self.healthy_to_restored_s - self.since_healthy_s

    @property
    def overhead_s(self) -> float:
        return self.healthy_to_restored_s - self.server_ms / 1000


def wait_healthy(url: str, *, timeout: float = 300.0) -> float:
    """Poll /health every 10 ms; return the unix time of the first 200."""
    return wait.wait_until(lambda: _healthy(url) and time.time(), timeout=timeout, what=f"{url}/health", every=0.01)


def _healthy(url: str) -> bool:
    try:
        status, _ = llamabed.http_json("GET", url + "/health", timeout=2.0)
    except OSError:
        return False
    return status == 200


def _nth_restore(side: sidecarbed.SidecarProcess, n: int) -> dict[str, Any] | None:
    found: list[dict[str, Any]] = side.log_events("slot_restored")
    return found[n] if len(found) > n else None


def run(bed: rig.Rig, *, tokens: int, restarts: int, say: rig.Say, seed: int = 7) -> tuple[list[Sample], int]:
    """Returns the samples and the snapshot's token count."""
    slot_dir = bed.slot_dir("restart")
    server = bed.server(slot_dir=slot_dir, n_slots=1, ctx_size=max(4096, tokens * 2))
    side = bed.sidecar(server, slot_dir)
    prompt = llamabed.make_prompt(server.url, tokens, seed=seed)
    llamabed.complete(server.url, prompt, n_predict=1, id_slot=0)
    side.wait_for(lambda: rig.snapshot_of(side, 0, int(tokens * 0.9)), timeout=120, what="snapshot")
    snap = rig.snapshot_of(side, 0, int(tokens * 0.9))
    assert snap is not None
    rng = random.Random(seed)
    samples = []
    for i in range(restarts):
        time.sleep(rng.uniform(0.2, 1.2))  # kill at a random phase of the sidecar's poll
        seen = len(side.log_events("slot_restored"))
        server.kill()
        started = time.time()
        server.start()
        healthy = wait_healthy(server.url)
        entry = side.wait_for(
            functools.partial(_nth_restore, side, seen), timeout=120, what=f"slot_restored after restart {i + 1}"
        )
        assert entry is not None
        samples.append(
            Sample(
                load_s=healthy - started,
                healthy_to_restored_s=rig.log_time(entry) - healthy,
                since_healthy_s=float(entry["since_healthy"]),
                call_s=float(entry["path_seconds"]),
                server_ms=float(entry["server_ms"]),
            )
        )
        say(f"  restart {i + 1}/{restarts}: healthy->restored {samples[-1].healthy_to_restored_s * 1000:.0f} ms")
    side.kill()
    server.kill()
    return samples, int(snap["tokens"])


def table(samples: list[Sample]) -> str:
    cols = [
        ("start -> healthy (ms)", [s.load_s for s in samples], 1000.0),
        ("healthy -> restored, bench clock (ms)", [s.healthy_to_restored_s for s in samples], 1000.0),
        ("  detection: healthy -> sidecar sees it (ms)", [s.detection_s for s in samples], 1000.0),
        ("  sidecar since_healthy (ms)", [s.since_healthy_s for s in samples], 1000.0),
        ("    slot read + restore call (ms)", [s.call_s for s in samples], 1000.0),
        ("    server restore_ms (ms)", [s.server_ms / 1000 for s in samples], 1000.0),
        ("sidecar overhead = restored - healthy - restore_ms (ms)", [s.overhead_s for s in samples], 1000.0),
    ]
    rows = [
        [name, rig.percentile(v, 50) * k, rig.percentile(v, 95) * k, max(v) * k if v else float("nan")]
        for name, v, k in cols
    ]
    return rig.table(["n=" + str(len(samples)), "p50", "p95", "max"], rows, digits=1)
