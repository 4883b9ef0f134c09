"""The one command against llama-server alone, side by side: what a user gets with no flag, per turn.

``python -m bench.defaults [--quick]`` (section ``defaults`` of ``python -m bench``). Two llama-servers
with the same arguments, at the server's defaults (its RAM prompt cache on), ``-np 2`` and more
conversations than slots (N=6; and N=20 without ``--quick``): one alone, one started by
``llama-kv-sidecar run -- <that same command>`` with no sidecar flag (the proxy takes the command's
``--port``, llama-server saves into a RAM staging dir, the block store lives in the state dir, given by
``XDG_STATE_HOME``). The turns are taken side by side as in the ``library`` section (:func:`library_paths._rounds`)
and judged the same way: the median over the timed turns of each turn through the one command ÷ the same
turn alone, at most :data:`library.DEFAULTS_PRICE`; a missed goal prints MISSED and the bench exits non-zero.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from bench import library, library_paths, rig, section
from bench.beds import net, wait
from sidecar.launch import argv as launch_argv

WAY = "defaults"
"""The label of the one command's path (a way of :class:`library_paths.Plan`)."""


class OneCommand:
    """``python -m sidecar run --listen 127.0.0.1:0 -- ARGV`` with its own state dir; ARGV keeps its ``--port``."""

    def __init__(self, server_argv: list[str], work: Path, log_dir: Path) -> None:
        self.port = net.free_port()
        argv = launch_argv.without(server_argv, (launch_argv.SLOT_SAVE_PATH, launch_argv.PORT))
        self.argv = [sys.executable, "-m", "sidecar", "run", "--listen", "127.0.0.1:0", "--log-format", "json",
                     "--", *argv, "--port", str(self.port)]  # fmt: skip
        self.state = work / "xdg"
        self.log = log_dir / f"defaults-{self.port}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_")}
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, env=env | {"XDG_STATE_HOME": str(self.state)}
            )
        wait.wait_until(self._healthy, timeout=300, what="the one command's /health", gone=self._gone)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as reply:
                return bool(reply.status == 200)
        except OSError:
            return False

    def _gone(self) -> str | None:
        code = self.proc.poll()
        return None if code is None else f"the one command exited with status {code} (log {self.log})"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.state, ignore_errors=True)


def pair(bed: rig.Rig, n: int, *, tokens: int, rounds: int, say: rig.Say) -> library_paths.Point:
    """llama-server alone and the one command in front of the same command, their turns side by side."""
    plan = library_paths.Plan(n, tokens, rounds, ram=True)
    alone = library_paths._open(bed, plan)
    assert alone.server is not None
    work = Path(tempfile.mkdtemp(prefix="llama-kv-bench-defaults-"))
    one = None
    try:
        one = OneCommand(alone.server.args(), work, bed.log_dir)
        ours = library_paths._Open(library_paths.Plan(n, tokens, rounds, ram=True, way=WAY), work, url=one.url)
        ours.chats = [library_paths._Chat(i, chat.messages[1]["content"]) for i, chat in enumerate(alone.chats)]
        library_paths._rounds([alone, ours], say)
        direct = library_paths.Run(n, library_paths.DIRECT, alone.times)
        proxied = library_paths.Run(n, library_paths.PROXY, ours.times, way=WAY)
        return library_paths.Point(n, direct, proxied, ram=True)
    finally:
        if one is not None:
            one.stop()
        library_paths._close(alone)
        shutil.rmtree(work, ignore_errors=True)


def verdicts(points: list[library_paths.Point]) -> list[str]:
    lines = []
    for p in points:
        price = p.paired_price
        lines.append(
            ("MET  " if price <= library.DEFAULTS_PRICE else "MISSED ")
            + f"the one command costs a turn at most {library.DEFAULTS_PRICE}x llama-server alone at the server's "
            f"defaults (N={p.conversations} on {library_paths.SLOTS} slots; the median of each turn's ratio to the "
            f"same turn alone, side by side): {price:.3f}x (median turn {rig.median(p.proxy.warm):.3f} s against "
            f"{rig.median(p.direct.warm):.3f} s alone; {rig.busy()})"
        )
    return lines


def table(points: list[library_paths.Point]) -> str:
    rows = [
        (p.conversations, rig.median(p.direct.warm), rig.median(p.proxy.warm), p.paired_price, len(p.proxy.warm))
        for p in points
    ]
    return rig.table(("N", "alone s", "one command s", "paired x", "turns"), rows)


def measure(bed: rig.Rig, *, quick: bool, say: rig.Say) -> tuple[list[library_paths.Point], str]:
    """``quick``: N=6 only, first messages of 400 tokens, the turns of one warm round; else N=6 and 20, 1,000."""
    tokens = 400 if quick else 1000
    sizes = [6] if quick else [6, 20]
    points = []
    for n in sizes:
        rounds = 1 if quick else -(-library.DEFAULTS_TURNS // n)
        points.append(pair(bed, n, tokens=tokens, rounds=rounds, say=say))
        say("so far:\n" + table(points))
    head = (
        f"llama-kv-sidecar run -- <llama-server {library_paths.SLOTS} slots, its RAM cache on> with no sidecar flag, "
        "against the same command alone\n\n"
    )
    return points, head + table(points) + "\n\n" + "\n".join(verdicts(points))


def main(argv: list[str] | None = None) -> int:
    return section.main(
        argv,
        name="defaults",
        doc=__doc__,
        title="The one command against llama-server alone, side by side",
        quick_help="N=6 only, first messages of 400 tokens, one warm round",
        measure=measure,
        missed=lambda points, _quick: any(line.startswith("MISSED") for line in verdicts(points)),
    )


if __name__ == "__main__":
    sys.exit(main())
