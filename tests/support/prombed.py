"""A real Prometheus (Debian's `prometheus`) scraping real targets, for tests."""

from __future__ import annotations

import shutil
import subprocess
import urllib.error
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import yaml

from tests.support import promql
from tests.support.net import free_port
from tests.support.wait import wait_until

ALERTS = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "alerts.yml"


class Prometheus:
    """`prometheus` scraping `targets` ({job: "host:port"}) every second, with the alert rules loaded."""

    def __init__(self, workdir: Path, targets: dict[str, str]) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError("prometheus is not installed: apt-get install -y prometheus")
        self.url = f"http://127.0.0.1:{free_port()}"
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(ALERTS)],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": [target]}]} for job, target in targets.items()
            ],
        }
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log_path = workdir / "prometheus.log"
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(
                [
                    binary,
                    f"--config.file={workdir / 'prometheus.yml'}",
                    f"--storage.tsdb.path={workdir / 'data'}",
                    f"--web.listen-address={self.url.removeprefix('http://')}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def query(self, expr: str) -> list[Any]:
        return promql.query(self.url, expr)

    def scalar(self, expr: str) -> float:
        """The single value of an instant query that must return exactly one series."""
        result = self.query(expr)
        assert len(result) == 1, f"{expr} returned {result}"
        return float(result[0]["value"][1])

    def wait_scraped(self, jobs: list[str], after: float, timeout: float = 30.0) -> None:
        """Wait until every job has been scraped successfully after wall time `after`, and twice in all.

        `rate()` and `increase()` need two samples in their range: on a fast machine the whole test
        can run within Prometheus's first scrape, and the range queries would have no data. `up`
        summed over time counts a job's successful scrapes.
        """

        def scraped() -> bool:
            try:
                seen = {r["metric"]["job"]: float(r["value"][1]) for r in self.query("timestamp(up == 1)")}
                count = {r["metric"]["job"]: float(r["value"][1]) for r in self.query("sum_over_time(up[1h])")}
            except (urllib.error.URLError, ConnectionError):
                return False
            return all(seen.get(job, 0.0) > after + 1.0 and count.get(job, 0.0) >= 2 for job in jobs)

        try:
            wait_until(scraped, timeout=timeout, what=f"a scrape of {jobs}", every=0.25, gone=self._exited)
        except AssertionError as err:
            raise AssertionError(f"{err}:\n{self.log_path.read_text()[-3000:]}") from None

    def _exited(self) -> str | None:
        return None if self.proc.poll() is None else f"prometheus exited ({self.proc.returncode})"

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
