"""HAProxy (Debian's package) running the shipped ``deploy/haproxy/haproxy.cfg``, on loopback only.

The config is used as shipped, with only what a test bed must change: its
listening port (a free loopback port), its server lines (the nodes the test
started), faster checks (so a node's going and coming shows in well under a
second), a stats socket (a unix socket in the bed's directory: the servers'
states and weights, read by :meth:`HAProxy.servers`), and two headers a test
reads: ``x-node`` on each answer (the server that took the request) and, with
``expose_key``, ``x-conv-key`` on each request (the conversation key the
config computed, as the node receives it).
"""

from __future__ import annotations

import re
import shutil
import signal
import socket
import subprocess
from pathlib import Path
from types import TracebackType
from typing import Self

from tests.support.net import free_port
from tests.support.wait import wait_until

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "deploy" / "haproxy" / "haproxy.cfg"
INSTALL = "apt-get install -y haproxy (Debian's package; scripts/test installs it when missing)"
CHECKS = "default-server check inter 300ms fall 2 rise 1 agent-check agent-inter 200ms weight 100"


def haproxy_binary() -> str:
    found = shutil.which("haproxy") or (shutil.which("haproxy", path="/usr/sbin:/sbin"))
    if found is None:
        raise AssertionError(f"haproxy is not installed: {INSTALL}")
    return found


def config_for(
    nodes: dict[str, tuple[int, int]], *, port: int, stats: Path, expose_key: bool = False, shipped: str = ""
) -> str:
    """The shipped config for ``nodes`` (name: (proxy port, agent port), on 127.0.0.1), listening on ``port``."""
    text = shipped or CONFIG.read_text()
    text = text.replace("bind 127.0.0.1:8000", f"bind 127.0.0.1:{port}")
    text = text.replace("global\n", f"global\n    stats socket {stats} mode 600 level admin\n", 1)
    text, n = re.subn(r"(?m)^    default-server .*$", "    " + CHECKS, text)
    assert n == 1, "the shipped config has one default-server line"
    text, n = re.subn(r"(?m)^    server .*\n", "", text)
    assert n >= 2, "the shipped config lists its nodes on server lines"
    lines = [f"    server {name} 127.0.0.1:{proxy} agent-port {agent}\n" for name, (proxy, agent) in nodes.items()]
    extra = "    http-response set-header x-node %[srv_name]\n"
    if expose_key:
        extra += "    http-request set-header x-conv-key %[var(txn.conv)]\n"
    text = text.replace("    balance hash", extra + "    balance hash", 1)
    return text.rstrip("\n") + "\n" + "".join(lines)


class HAProxy:
    def __init__(self, workdir: Path, nodes: dict[str, tuple[int, int]], *, expose_key: bool = False) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.stats = workdir / "haproxy-stats.sock"
        self.path = workdir / "haproxy.cfg"
        self.path.write_text(config_for(nodes, port=self.port, stats=self.stats, expose_key=expose_key))
        self.log_path = workdir / "haproxy.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Self:
        binary = haproxy_binary()
        check = subprocess.run([binary, "-c", "-f", str(self.path)], capture_output=True, text=True, check=False)
        assert check.returncode == 0, f"haproxy -c refused the bed's config:\n{check.stdout}{check.stderr}"
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [binary, "-db", "-f", str(self.path)], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        wait_until(self._listening, timeout=10, what="haproxy listening", gone=self._exited)
        return self

    def _listening(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return self.stats.exists()
        except OSError:
            return False

    def _exited(self) -> str | None:
        if self.proc is not None and self.proc.poll() is not None:
            return f"haproxy exited ({self.proc.returncode}):\n{self.log_path.read_text(errors='replace')[-2000:]}"
        return None

    def command(self, line: str) -> str:
        """One command on the stats socket, its answer."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(5)
            sock.connect(str(self.stats))
            sock.sendall(line.encode() + b"\n")
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    def servers(self) -> dict[str, tuple[str, int]]:
        """Each server's status as HAProxy shows it (``UP``, ``DOWN``, ``DRAIN``, ...) and its current weight."""
        rows = self.command("show stat -1 4 -1").splitlines()
        head = rows[0].lstrip("# ").split(",")
        status, weight, name = head.index("status"), head.index("weight"), head.index("svname")
        found = {}
        for row in rows[1:]:
            cells = row.split(",")
            if len(cells) > weight:
                found[cells[name]] = (cells[status], int(cells[weight] or 0))
        return found

    def wait_status(self, server: str, status: str, *, timeout: float = 60.0) -> None:
        wait_until(
            lambda: self.servers().get(server, ("", 0))[0].startswith(status),
            timeout=timeout,
            what=f"haproxy to show {server} {status} (now {self.servers()})",
            every=0.1,
            gone=self._exited,
        )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR1)  # soft stop
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
