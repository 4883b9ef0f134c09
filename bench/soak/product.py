"""The processes of a soak: the product as users run it, the S3 server, the store's disk, a reference server.

:class:`Product` is ``llama-kv-sidecar run`` in launcher mode with the proxy on a fixed port (clients
come back to it after each restart), the block store on a size-limited tmpfs, the shared store on the
S3 server and llama-server's RAM cache at its default. :func:`missing` names what a run needs and does
not have. Every process is started in a session of its own and killed by :meth:`Product.close` and the
runner's clean-up, whatever ends the run.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from bench.beds import llamabed, net, wait
from tests.support.environ import child_env
from tests.support.readers import parse_metrics, sample

SLOTS = 2
CTX_PER_SLOT = 4096
BUCKET = "soak"
MIN_FREE = 32 << 20
"""--min-free-bytes: the store's disk is small (its default, 1 GiB, would skip every save there)."""


def missing() -> list[str]:
    """What a soak needs and this machine lacks, each with what to do; [] when all is there."""
    out = []
    if not os.access(llamabed.cached_binary(), os.X_OK):
        out.append(f"llama-server is not built at {llamabed.cached_binary()}: run scripts/setup")
    try:
        from tests.support import s3bed  # noqa: PLC0415 - the S3 bed's own check

        s3bed.weed_binary()
    except RuntimeError as exc:
        out.append(str(exc))
    if os.geteuid() != 0:
        out.append("the store's disk is a size-limited tmpfs mounted for the run: run the soak as root")
    if sys.platform != "linux":
        out.append("the soak reads /proc and mounts a tmpfs: it runs on Linux")
    return out


def _get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return int(reply.status), reply.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()


class Product:
    """``llama-kv-sidecar run ... -- llama-server ...``, started again after each fault that ends it."""

    def __init__(
        self,
        *,
        binary: Path,
        model: Path,
        work: Path,
        store: Path,
        s3_env: dict[str, str],
        max_bytes: int,
        save_hold: float,
    ) -> None:
        self._binary, self._model, self._work, self.store = binary, model, work, store
        self.slot_dir = work / "slots"
        self.slot_dir.mkdir(parents=True, exist_ok=True)
        self._s3_env, self._max_bytes, self._save_hold = s3_env, max_bytes, save_hold
        self._proxy_port = net.free_port()
        self._status_port = net.free_port()
        self._log_path = work / "sidecar.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        """Where the clients send their requests: the proxy."""
        return f"http://127.0.0.1:{self._proxy_port}"

    @property
    def _status_url(self) -> str:
        return f"http://127.0.0.1:{self._status_port}"

    def _argv(self) -> list[str]:
        server = [str(self._binary), "-m", str(self._model), "-np", str(SLOTS), "-c", str(SLOTS * CTX_PER_SLOT)]
        server += ["-t", "2"] + ([] if llamabed.cpu_has_amx() else ["--no-repack"])
        return [
            sys.executable, "-m", "sidecar", "run",
            "--proxy-listen", f"127.0.0.1:{self._proxy_port}",
            "--listen", f"127.0.0.1:{self._status_port}",
            "--slot-dir", str(self.slot_dir),
            "--store-dir", str(self.store),
            "--shared-store", f"s3://{BUCKET}/node-a",
            "--max-bytes", str(self._max_bytes),
            "--min-free-bytes", str(MIN_FREE),
            "--save-hold-seconds", str(self._save_hold),
            "--log-format", "json",
            "--", *server,
        ]  # fmt: skip

    def start(self) -> None:
        """Start it (not waited for: see :meth:`wait_ready`)."""
        with self._log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                self._argv(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=child_env(self._s3_env),
            )
        self.starts += 1

    def _alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def wait_ready(self, timeout: float = 180.0) -> None:
        """Until ``/readyz`` answers 200 (its llama-server up, the restore round done)."""
        wait.wait_until(self._ready, timeout=timeout, what="the sidecar ready", every=0.2, gone=self._exited)

    def _ready(self) -> bool:
        try:
            return _get(self._status_url + "/readyz", timeout=2.0)[0] == 200
        except OSError:
            return False

    def _exited(self) -> str | None:
        if self._proc is None or self._proc.poll() is None:
            return None
        return f"the sidecar exited with status {self._proc.returncode}; its log: {self._log_path}"

    def _status(self) -> dict[str, Any]:
        code, body = _get(self._status_url + "/status")
        if code != 200:
            raise RuntimeError(f"/status answered HTTP {code}")
        result: dict[str, Any] = json.loads(body)
        return result

    def child_pid(self) -> int | None:
        """The running llama-server's pid, or None (not running, or the sidecar does not answer)."""
        try:
            pid = self._status()["launcher"]["pid"]
        except (OSError, RuntimeError, KeyError, TypeError, ValueError):
            return None
        return int(pid) if pid else None

    def metric(self, name: str, **labels: str) -> float | None:
        """A metric's value now (summed over matching labels); None when the sidecar does not answer."""
        try:
            code, body = _get(self._status_url + "/metrics")
        except OSError:
            return None
        return sample(parse_metrics(body.decode()), name, **labels) if code == 200 else None

    def kill9(self) -> None:
        """``kill -9`` of the sidecar alone (its llama-server must go with it by itself)."""
        if self._proc is not None and self._proc.poll() is None:
            os.kill(self._proc.pid, signal.SIGKILL)
            self._proc.wait()

    def sigterm(self, timeout: float = 90.0) -> tuple[int, float]:
        """SIGTERM, as a service manager stops it: its exit status and the seconds it took."""
        assert self._proc is not None
        started = time.monotonic()
        self._proc.send_signal(signal.SIGTERM)
        try:
            code = self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.close()
            code = -9
        return code, time.monotonic() - started

    def usage(self) -> dict[str, float]:
        """The sidecar's resident memory, open files and threads now ({} when it is not running)."""
        if self._proc is None or self._proc.poll() is not None:
            return {}
        pid = self._proc.pid
        with contextlib.suppress(OSError, KeyError, ValueError):  # gone, or a zombie (no VmRSS)
            fields = dict(
                line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
            )
            return {
                "rss_bytes": float(int(fields["VmRSS"].split()[0]) * 1024),
                "threads": float(int(fields["Threads"])),
                "open_files": float(len(os.listdir(f"/proc/{pid}/fd"))),
            }
        return {}

    def close(self) -> None:
        """Kill it and its process group (its llama-server too), whatever state it is in."""
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
            self._proc.wait()


def servers_of(slot_dir: Path) -> list[int]:
    """The pids of llama-server processes started for ``slot_dir`` (by the argument the launcher adds)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"llama-server") and str(slot_dir).encode() in b" ".join(argv):
            with contextlib.suppress(OSError):
                if (entry / "stat").read_text().split(")")[-1].split()[0] != "Z":
                    found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def store_bytes(root: Path) -> int:
    """Bytes the store's files take."""
    total = 0
    for path in root.rglob("*"):
        with contextlib.suppress(OSError):
            if path.is_file():
                total += path.stat().st_size
    return total
