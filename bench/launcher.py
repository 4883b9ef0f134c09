"""Launcher mode after a kill -9: the next turn's first token, against beside mode and against no crash.

``python -m bench.launcher [--quick]`` (section ``launcher`` of ``python -m bench``). Two figures, each a
ratio of two sides measured in the same run:

* **From the death**: one conversation (~1,500 tokens) through the proxy, snapshotted; then llama-server is
  killed with SIGKILL and the same next turn is sent at once, streamed, and timed from the kill to its first
  token. Launcher mode (``run ... -- llama-server ...``: the sidecar restarts its child) against beside
  mode with an external restart loop (a bash loop that starts llama-server again 0.1 s after it ends,
  systemd's default ``RestartSec``; ``scripts/demo`` waits 1 s), the sidecar watching it. The sides
  alternate; each launcher sample starts a fresh launcher on the same slot dir, since a second end within
  a minute is backed off by design (:mod:`sidecar.launch.restarts`). Goal: at most 1.0x.
* **The waiting conversation**: 2 slots and 4 conversations (A and C saved from slot 0, B and D from slot 1,
  C and D the newest), in launcher mode. A's next turn, timed to its first token, sent as soon as the
  restarted llama-server answers ``/health`` (it waits at the restore gate, which restores A first), against
  the same turn with no crash (the library swaps A in). Goal: at most 1.2x.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import proxy as proxy_mod
from bench import rig, section
from bench.beds import llamabed, net, sidecarbed, wait

FROM_DEATH_GOAL = 1.0
"""Launcher over beside mode with an external restart loop: kill -9 to the next turn's first token."""
WAITING_GOAL = 1.2
"""The waiting conversation's first token after a restart over the same turn with no crash."""
LOOP_DELAY = 0.1
"""Seconds the external restart loop waits before starting llama-server again (systemd's RestartSec default)."""
TOKENS = 1500
SLOTS = 2
CTX = 4096
"""Tokens per slot."""
PATH = "/v1/chat/completions"


class Launched(sidecarbed.SidecarProcess):
    """The sidecar as the launcher of llama-server (``run ... -- ARGV``)."""

    def __init__(self, server_argv: list[str], slot_dir: Path, log_path: Path, extra: dict[str, str]) -> None:
        super().__init__("", slot_dir, log_path, extra=extra)
        self.server_argv = server_argv

    def args(self) -> list[str]:
        cmd = super().args()
        at = cmd.index("--server")
        return [*cmd[:at], *cmd[at + 2 :], "--", *self.server_argv]

    def child(self) -> tuple[int, int]:
        """The running child's pid (from ``/status``) and llama-server's port (from the launch line)."""
        argv = self.log_events("launcher_started")[-1]["argv"]
        pid = self.status()["launcher"]["pid"]
        if pid is None:
            raise rig.BenchError("the launcher runs no llama-server")
        return int(pid), int(argv[argv.index("--port") + 1])


class Loop:
    """llama-server started again by a bash loop whenever it ends (beside mode's restart)."""

    def __init__(self, server: llamabed.LlamaServer, log_dir: Path) -> None:
        self.server, self.pidfile = server, log_dir / "loop.pid"
        script = f'while true; do "$@" & echo $! > {self.pidfile}; wait $!; sleep {LOOP_DELAY}; done'
        with (log_dir / "loop-llama-server.log").open("ab") as out:
            self.proc = subprocess.Popen(
                ["bash", "-c", script, "loop", *server.args()],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def pid(self) -> int:
        return int(self.pidfile.read_text())

    def close(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def _healthy(port: int) -> bool:
    try:
        status, _ = llamabed.http_json("GET", f"http://127.0.0.1:{port}/health", timeout=2.0)
    except OSError:
        return False
    return status == 200


def _turn(messages: list[dict[str, str]]) -> dict[str, object]:
    return {"messages": messages, "max_tokens": 4, "temperature": 0, "stream": True, "cache_prompt": True}


def _first_token(port: int, messages: list[dict[str, str]]) -> tuple[float, int]:
    """A streamed turn on a new connection: (ms from sending it to its first byte: the first token, cache_n)."""
    conn = proxy_mod.Conn(port)
    try:
        first, _ = conn.timed_both(PATH, _turn(messages))
    finally:
        conn.close()
    found = re.findall(rb'"cache_n":\s*(\d+)', conn.answer)
    return first, int(found[-1]) if found else -1


def _answer(port: int, messages: list[dict[str, str]], slot: int | None = None) -> list[dict[str, str]]:
    """A non-streamed turn (pinned to ``slot`` if given); the messages of the conversation's next turn."""
    body: dict[str, Any] = {"messages": messages, "max_tokens": 4, "temperature": 0}
    if slot is not None:
        body["id_slot"] = slot
    status, reply = llamabed.http_json("POST", f"http://127.0.0.1:{port}{PATH}", body, timeout=300)
    if status != 200:
        raise rig.BenchError(f"a turn answered HTTP {status}: {str(reply)[:300]}")
    text = reply["choices"][0]["message"].get("content") or ""
    return [*messages, {"role": "assistant", "content": text}, {"role": "user", "content": rig.NEXT_TURN}]


def _saved(side: sidecarbed.SidecarProcess, since: int, slots: set[int]) -> Callable[[], bool]:
    """Whether each of ``slots`` has had a snapshot committed since the ``since``-th."""
    return lambda: slots <= {int(e["slot"]) for e in side.log_events("snapshot_committed")[since:]}


def _ready(side: sidecarbed.SidecarProcess) -> Callable[[], bool]:
    return lambda: side.get("/readyz")[0] == 200


def _up(port: int, *, up: bool = True) -> Callable[[], bool]:
    return lambda: _healthy(port) == up


@dataclasses.dataclass(slots=True)
class Result:
    launcher_ms: list[float]
    """Kill -9 of llama-server to the next turn's first token, launcher mode."""
    beside_ms: list[float]
    """The same, beside mode with the external restart loop."""
    crashed_ms: list[float]
    """The waiting conversation's turn from the restarted server's /health ok to its first token."""
    calm_ms: list[float]
    """The same turn with no crash."""
    cache_n: dict[str, list[int]]
    quick: bool

    @property
    def from_death(self) -> float:
        return rig.median(self.launcher_ms) / rig.median(self.beside_ms)

    @property
    def waiting(self) -> float:
        return rig.median(self.crashed_ms) / rig.median(self.calm_ms)


def _server_argv(bed: rig.Rig, port: int, slot_dir: Path) -> llamabed.LlamaServer:
    return llamabed.LlamaServer(
        bed.binary, bed.model, swa_full=True, slot_dir=slot_dir, n_slots=SLOTS, ctx_size=CTX, log_dir=bed.log_dir,
        threads=bed.threads, port=port,
    )  # fmt: skip


def _launch_argv(server: llamabed.LlamaServer) -> list[str]:
    """The server's command line without what the launcher adds itself (address, slot dir, --metrics)."""
    out: list[str] = []
    args = iter(server.args())
    for arg in args:
        if arg in ("--host", "--port", "--slot-save-path"):
            next(args)
        elif arg != "--metrics":
            out.append(arg)
    return out


def _launcher(bed: rig.Rig, slot_dir: Path, name: str) -> tuple[Launched, int]:
    """A launcher on ``slot_dir``, ready (its restore at start done); and its proxy's port."""
    port = net.free_port()
    argv = _launch_argv(_server_argv(bed, net.free_port(), slot_dir))
    side = Launched(
        argv, slot_dir, bed.log_dir / f"{name}.log", {**rig.SIDECAR_DEFAULTS, "--proxy-listen": f"127.0.0.1:{port}"}
    )
    side.start()
    side.wait_for(_ready(side), timeout=300, what="the launcher ready")
    return side, port


def _killed_to_first_token(pid: int, port: int, messages: list[dict[str, str]]) -> tuple[float, int]:
    killed = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    sent = time.perf_counter()
    ms, cache_n = _first_token(port, messages)
    return ms + (sent - killed) * 1000, cache_n


def from_death(bed: rig.Rig, *, reps: int, say: rig.Say) -> tuple[list[float], list[float], dict[str, list[int]]]:
    """Kill -9 to the next turn's first token: launcher mode, and beside mode with an external restart loop."""
    dirs = {mode: bed.slot_dir(f"launcher-{mode}") for mode in ("launcher", "beside")}
    server = _server_argv(bed, net.free_port(), dirs["beside"])
    loop = Loop(server, bed.log_dir)
    proxy_port = net.free_port()
    beside = sidecarbed.SidecarProcess(
        server.url,
        dirs["beside"],
        bed.log_dir / "launcher-beside.log",
        extra={**rig.SIDECAR_DEFAULTS, "--proxy-listen": f"127.0.0.1:{proxy_port}"},
    )
    try:
        wait.wait_until(_up(server.port), timeout=300, what="the looped llama-server")
        beside.start()
        beside.wait_for(_ready(beside), timeout=120, what="the sidecar beside")
        prompt = llamabed.make_prompt(server.url, TOKENS, seed=1201)
        start = [{"role": "user", "content": prompt}]
        since = len(beside.log_events("snapshot_committed"))
        following = _answer(proxy_port, start)
        beside.wait_for(lambda: bool(beside.log_events("snapshot_committed")[since:]), timeout=120, what="a snapshot")
        side, port = _launcher(bed, dirs["launcher"], "launcher-00")
        since = len(side.log_events("snapshot_committed"))
        _answer(port, start)
        side.wait_for(lambda: bool(side.log_events("snapshot_committed")[since:]), timeout=120, what="a snapshot")
        times: dict[str, list[float]] = {"launcher": [], "beside": []}
        cache: dict[str, list[int]] = {"launcher": [], "beside": []}
        for r in range(reps):
            for mode in ("launcher", "beside") if r % 2 == 0 else ("beside", "launcher"):
                if mode == "launcher":
                    if r > 0:  # a fresh launcher: its child's first end restarts at once
                        side.terminate(timeout=60)
                        side, port = _launcher(bed, dirs["launcher"], f"launcher-{r:02d}")
                    ms, n = _killed_to_first_token(side.child()[0], port, following)
                else:
                    beside.wait_for(_ready(beside), timeout=120, what="the sidecar ready")
                    ms, n = _killed_to_first_token(loop.pid(), proxy_port, following)
                times[mode].append(ms)
                cache[mode].append(n)
                say(f"  kill -9 {r + 1}/{reps}, {mode}: first token {ms:.0f} ms after the kill (cache_n {n})")
        side.terminate(timeout=60)
    finally:
        beside.kill()
        loop.close()
    return times["launcher"], times["beside"], cache


def waiting(bed: rig.Rig, *, reps: int, say: rig.Say) -> tuple[list[float], list[float], dict[str, list[int]]]:
    """2 slots, 4 conversations: A's turn right after a restart (A is no slot's newest) against no crash."""
    slot_dir = bed.slot_dir("launcher-four")
    side, port = _launcher(bed, slot_dir, "launcher-four")
    pid, server_port = side.child()
    url = f"http://127.0.0.1:{server_port}"
    chats = [[{"role": "user", "content": llamabed.make_prompt(url, TOKENS, seed=1300 + n)}] for n in range(4)]
    for n in range(4):  # A, B, C, D into slots 0, 1, 0, 1, straight to llama-server, each saved
        since = len(side.log_events("snapshot_committed"))
        chats[n] = _answer(server_port, chats[n], slot=n % 2)
        side.wait_for(_saved(side, since, {n % 2}), timeout=120, what="a snapshot")
    crashed, calm = [], []
    cache: dict[str, list[int]] = {"crashed": [], "calm": []}
    try:
        for r in range(reps):
            turn = [*chats[0][:-1], {"role": "user", "content": f"{rig.NEXT_TURN} (turn {r})"}]
            side.wait_for(_ready(side), timeout=120, what="the sidecar ready")
            ms, n = _first_token(port, turn)  # no crash: A is in no slot, the library swaps it in
            calm.append(ms)
            cache["calm"].append(n)
            since = len(side.log_events("snapshot_committed"))
            for c in (2, 3):  # C and D back on top of their slots, newer than A's snapshot
                chats[c] = _answer(server_port, chats[c], slot=c % 2)
            side.wait_for(_saved(side, since, {0, 1}), timeout=120, what="C and D saved")
            if r > 0:  # a fresh launcher: its child's first end restarts at once
                side.terminate(timeout=60)
                side, port = _launcher(bed, slot_dir, f"launcher-four-{r:02d}")
            pid, server_port = side.child()
            os.kill(pid, signal.SIGKILL)
            wait.wait_until(_up(server_port, up=False), timeout=30, what="the killed server gone", every=0.005)
            wait.wait_until(_up(server_port), timeout=300, what="the restarted server", every=0.005)
            ms, n = _first_token(port, turn)
            crashed.append(ms)
            cache["crashed"].append(n)
            say(f"  restart {r + 1}/{reps}: A's turn {ms:.0f} ms from /health ok (cache_n {n}) vs {calm[-1]:.0f} ms")
    finally:
        side.terminate(timeout=60)
    return crashed, calm, cache


def run(bed: rig.Rig, *, reps: int, quick: bool, say: rig.Say) -> Result:
    launcher_ms, beside_ms, death_cache = from_death(bed, reps=reps, say=say)
    crashed_ms, calm_ms, waiting_cache = waiting(bed, reps=reps, say=say)
    return Result(launcher_ms, beside_ms, crashed_ms, calm_ms, {**death_cache, **waiting_cache}, quick)


def judged(r: Result) -> list[tuple[str, str, bool | None]]:
    """(goal, measured, met: None for NO VERDICT) of each goal."""
    death_rounds = [a / b for a, b in zip(r.launcher_ms, r.beside_ms, strict=False)]
    wait_rounds = [a / b for a, b in zip(r.crashed_ms, r.calm_ms, strict=False)]
    return [
        (
            f"launcher: kill -9 to the next turn's first token <= {FROM_DEATH_GOAL:g}x beside mode with an external "
            "restart loop",
            f"{r.from_death:.3f}x ({rig.median(r.launcher_ms):.0f} vs {rig.median(r.beside_ms):.0f} ms; per pair "
            f"{', '.join(f'{v:.2f}' for v in death_rounds)})",
            rig.decide(r.from_death, FROM_DEATH_GOAL, rounds=death_rounds, quick=r.quick),
        ),
        (
            f"launcher: 2 slots, 4 conversations, the waiting one's first token after a restart (from /health ok) "
            f"<= {WAITING_GOAL:g}x the same turn with no crash",
            f"{r.waiting:.3f}x ({rig.median(r.crashed_ms):.0f} vs {rig.median(r.calm_ms):.0f} ms; per restart "
            f"{', '.join(f'{v:.2f}' for v in wait_rounds)}; cache_n {r.cache_n.get('crashed')} after, "
            f"{r.cache_n.get('calm')} without)",
            rig.decide(r.waiting, WAITING_GOAL, rounds=wait_rounds, quick=r.quick),
        ),
    ]


def verdicts(r: Result) -> list[str]:
    return [f"{rig.word(met):10}  {goal}: {measured}" for goal, measured, met in judged(r)]


def table(r: Result) -> str:
    def row(name: str, values: list[float], cache_n: list[int] | None) -> list[object]:
        return [name, len(values), rig.median(values), "/".join(f"{v:.0f}" for v in values), str(cache_n)]

    body = rig.table(
        ["turn", "n", "p50 ms", "runs ms", "cache_n"],
        [
            row("kill -9 to 1st token, launcher", r.launcher_ms, r.cache_n.get("launcher")),
            row(f"kill -9 to 1st token, beside + loop ({LOOP_DELAY:g} s)", r.beside_ms, r.cache_n.get("beside")),
            row("4 chats/2 slots: waiting turn, /health ok to 1st token", r.crashed_ms, r.cache_n.get("crashed")),
            row("4 chats/2 slots: same turn, no crash", r.calm_ms, r.cache_n.get("calm")),
        ],
        left=True,
    )
    note = f"({SLOTS} slots of {CTX:,} tokens, conversations of ~{TOKENS:,} tokens, streamed turns of 4 tokens)"
    return "\n".join([body, note, "", *verdicts(r)])


def measure(bed: rig.Rig, *, quick: bool, say: rig.Say) -> tuple[Result, str]:
    result = run(bed, reps=3 if quick else 6, quick=quick, say=say)
    return result, table(result)


def main(argv: list[str] | None = None) -> int:
    return section.main(
        argv,
        name="launcher",
        doc=__doc__,
        title="Launcher mode after a kill -9",
        quick_help="3 kills of each kind instead of 6",
        measure=measure,
        missed=lambda result, quick: any(met is False for _, _, met in judged(result)),
    )


if __name__ == "__main__":
    sys.exit(main())
