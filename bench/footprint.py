"""What the sidecar costs the machine: CPU share and resident memory.

Read from `/proc/<pid>/task/*/schedstat` (on-CPU time of all threads, over a
window) and `/proc/<pid>/status` (VmRSS, VmHWM), for the sidecar and for
llama-server (`-np 2`), in five states:

* server idle, sidecar at the default `--poll-interval 1.0`;
* server streaming tokens on slot 0, sidecar at 1.0;
* under load: server streaming on slot 0 while slot 1 grows every 3.5 s and
  the sidecar (`--save-hold-seconds 0`) saves it after each change: polls,
  checksum and fdatasync of each new file;
* server idle, sidecar at `--poll-interval 0.25`;
* server down (killed), the sidecar polling `/health` every 0.25 s.

CPU share is CPU seconds per wall second: 1.0 is one core busy. Beside the
sidecar, in the same window, runs a bare asyncio loop that only sleeps for
the same interval: what any Python process waking that often costs on this
machine (on some virtual machines each wake-up after an idle second costs
milliseconds). The sidecar's own work per poll is the difference. Both CPU
and RSS are also given as ratios to llama-server's in the same window.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading
import time

from bench import client, rig, stall
from bench.beds import llamabed, sidecarbed, wait

BARE_LOOP = """
import asyncio, sys
async def main(every):
    while True:
        await asyncio.sleep(every)
asyncio.run(main(float(sys.argv[1])))
"""


@dataclasses.dataclass(frozen=True, slots=True)
class State:
    name: str
    polls_per_s: float
    seconds: float
    sidecar_cpu: float
    bare_cpu: float
    sidecar_rss: int
    sidecar_hwm: int
    server_cpu: float | None
    server_rss: int | None

    @property
    def cpu_ms_per_poll(self) -> float:
        return self.sidecar_cpu * 1000 / self.polls_per_s

    @property
    def net_ms_per_poll(self) -> float:
        return (self.sidecar_cpu - self.bare_cpu) * 1000 / self.polls_per_s

    @property
    def cpu_share(self) -> float | None:
        """Sidecar CPU over llama-server CPU in the same window (None: server down or idle at 0)."""
        return self.sidecar_cpu / self.server_cpu if self.server_cpu else None

    @property
    def rss_share(self) -> float | None:
        """Sidecar RSS over llama-server RSS (None: server down)."""
        return self.sidecar_rss / self.server_rss if self.server_rss else None


def sample(
    name: str, side: sidecarbed.SidecarProcess, server: llamabed.LlamaServer | None, *, seconds: float, polls: float
) -> State:
    assert side.proc is not None
    s_pid = side.proc.pid
    v_pid = server.pid if server is not None else None
    bare = subprocess.Popen([sys.executable, "-c", BARE_LOOP, str(1 / polls)])
    try:
        time.sleep(1.0)
        s0, b0 = rig.cpu_seconds(s_pid), rig.cpu_seconds(bare.pid)
        v0 = rig.cpu_seconds(v_pid) if v_pid is not None else 0.0
        t0 = time.monotonic()
        time.sleep(seconds)
        wall = time.monotonic() - t0
        s1, b1 = rig.cpu_seconds(s_pid), rig.cpu_seconds(bare.pid)
        v1 = rig.cpu_seconds(v_pid) if v_pid is not None else 0.0
    finally:
        bare.kill()
        bare.wait()
    rss, hwm = rig.rss_bytes(s_pid)
    return State(
        name=name,
        polls_per_s=polls,
        seconds=wall,
        sidecar_cpu=(s1 - s0) / wall,
        bare_cpu=(b1 - b0) / wall,
        sidecar_rss=rss,
        sidecar_hwm=hwm,
        server_cpu=(v1 - v0) / wall if v_pid is not None else None,
        server_rss=rig.rss_bytes(v_pid)[0] if v_pid is not None else None,
    )


STREAMING = "server streaming, poll 1.0 s"
SAVING = "server streaming, sidecar saving slot 1 (hold off)"


def run(bed: rig.Rig, *, seconds: float, say: rig.Say) -> list[State]:
    slot_dir = bed.slot_dir("footprint")
    server = bed.server(slot_dir=slot_dir, n_slots=2, ctx_size=8192)
    llamabed.complete(server.url, llamabed.make_prompt(server.url, 1024, seed=21), n_predict=1, id_slot=0)
    convo = [llamabed.make_prompt(server.url, 2048, seed=22)]
    llamabed.complete(server.url, convo[0], n_predict=1, id_slot=1)
    states = []

    side = bed.sidecar(server, slot_dir)
    side.wait_for(lambda: rig.snapshot_of(side, 0, 512), timeout=60, what="snapshot")
    side.wait_for(lambda: rig.snapshot_of(side, 1, 1024), timeout=60, what="snapshot")
    client.settle(side)
    states.append(sample("server idle, poll 1.0 s", side, server, seconds=seconds, polls=1.0))
    say(f"  {states[-1].name}: sidecar {states[-1].sidecar_cpu * 100:.2f}% of a core")

    times: list[float] = []
    streamer = threading.Thread(target=client.stream, args=(server.port, seconds + 4, times), daemon=True)
    streamer.start()
    wait.wait_until(lambda: len(times) >= 2, timeout=120, what="first streamed tokens")
    states.append(sample(STREAMING, side, server, seconds=seconds, polls=1.0))
    say(f"  {states[-1].name}: sidecar {states[-1].sidecar_cpu * 100:.2f}% of a core")
    streamer.join(timeout=120)
    rig.wait_idle(server.url)
    client.settle(side)
    side.kill()

    side = bed.sidecar(server, slot_dir, **{"--save-hold-seconds": "0"})
    client.settle(side)
    saves_before = len(side.log_events("snapshot_committed"))
    traffic = threading.Thread(
        target=stall.window,
        args=(server, convo),
        kwargs={"seconds": seconds + 8, "period": 3.5, "save_after": None, "save_ms": [], "slot_dir": slot_dir},
        daemon=True,
    )
    traffic.start()
    time.sleep(4.0)  # the stream has started and slot 1 changed once
    states.append(sample(SAVING, side, server, seconds=seconds, polls=1.0))
    traffic.join(timeout=seconds + 120)
    client.settle(side)  # the commits that waited for the stream's end are logged
    saves = len(side.log_events("snapshot_committed")) - saves_before
    if not saves:  # the traffic thread died (its traceback is above), or the sidecar saved nothing
        raise rig.BenchError(f"'{SAVING}': the sidecar made no save while slot 1 changed; its log: {side.log_path}")
    say(f"  {states[-1].name}: sidecar {states[-1].sidecar_cpu * 100:.2f}% of a core, {saves} saves")
    side.kill()

    side = bed.sidecar(server, slot_dir, **{"--poll-interval": "0.25"})
    client.settle(side)
    states.append(sample("server idle, poll 0.25 s", side, server, seconds=seconds, polls=4.0))
    say(f"  {states[-1].name}: sidecar {states[-1].sidecar_cpu * 100:.2f}% of a core")

    server.kill()
    time.sleep(1.0)
    states.append(sample("server down, /health every 0.25 s", side, None, seconds=seconds, polls=4.0))
    say(f"  {states[-1].name}: sidecar {states[-1].sidecar_cpu * 100:.2f}% of a core")
    side.kill()
    return states


def table(states: list[State]) -> str:
    mib = 1 << 20
    rows = [
        [
            s.name,
            f"{s.sidecar_cpu * 100:.2f}",
            f"{s.bare_cpu * 100:.2f}",
            f"{s.cpu_ms_per_poll:.2f}",
            f"{s.net_ms_per_poll:.2f}",
            f"{s.sidecar_rss / mib:.1f}",
            f"{s.sidecar_hwm / mib:.1f}",
            "-" if s.server_cpu is None else f"{s.server_cpu * 100:.1f}",
            "-" if s.server_rss is None else f"{s.server_rss / mib:.0f}",
            "-" if s.cpu_share is None else f"{s.cpu_share:.2%}",
            "-" if s.rss_share is None else f"{s.rss_share:.1%}",
        ]
        for s in states
    ]
    headers = [
        "state",
        "sidecar CPU %",
        "bare loop CPU %",
        "sidecar CPU ms/poll",
        "minus bare loop",
        "sidecar RSS MiB",
        "peak MiB",
        "server CPU %",
        "server RSS MiB",
        "CPU vs server",
        "RSS vs server",
    ]
    return rig.table(headers, rows)
