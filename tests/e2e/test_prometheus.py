"""A real Prometheus scrapes a real sidecar and llama-server through a restart.

Every query below returns the value the test computes independently (from
the sidecar's log, the slot dir, or llama-server's own /metrics), and every
PromQL expression of the dashboard and the alert rules runs without error.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.support import promql
from tests.support.llamabed import MakeServer, complete, make_prompt
from tests.support.prombed import Prometheus
from tests.support.readers import has_sample, sample, scrape
from tests.support.sidecarbed import MakeSidecar, SidecarProcess

BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def _server_counter(url: str, name: str) -> float:
    samples = scrape(url + "/metrics")
    assert has_sample(samples, name), f"{name} not in llama-server's /metrics"
    return sample(samples, name)


def _gauge_matches_disk(side: SidecarProcess, slot_dir: Path) -> int:
    """The slot dir's bytes once the sidecar's disk gauge shows them (0 until then)."""
    on_disk = sum(p.stat().st_size for p in slot_dir.iterdir() if p.is_file())
    return on_disk if side.metric("llama_sidecar_disk_used_bytes") == on_disk else 0


@pytest.mark.prometheus
def test_prometheus_sees_restart_restore_hit_rate_latency_tokens_and_disk(
    llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path, tmp_path: Path
) -> None:
    server = llama(slot_dir=slot_dir)
    side = sidecar(server, slot_dir)
    targets = {"llama-kv-sidecar": f"127.0.0.1:{side.port}", "llama-server": f"127.0.0.1:{server.port}"}
    with Prometheus(tmp_path / "prometheus", targets) as prom:
        prompt = make_prompt(server.url, 1024, seed=31)
        complete(server.url, prompt)
        side.wait_saved()
        server.restart(graceful=False)
        side.wait_restored()
        complete(server.url, prompt + " then more")
        side.wait_for(
            lambda: side.metric("llama_sidecar_restore_verifications_total", outcome="effective") >= 1,
            what="verification",
        )
        # The follow-up turn changed the slot: let its snapshot land, and the sidecar's disk gauge
        # agree with the directory, so the disk is quiet while we compare.
        side.wait_saved(2)
        on_disk = side.wait_for(lambda: _gauge_matches_disk(side, slot_dir), what="the disk gauge to settle")
        prom.wait_scraped(list(targets), after=time.time())

        assert prom.scalar("llama_sidecar_server_up") == 1
        assert prom.scalar("llama_sidecar_server_restarts_total") == 1
        hit_rate = prom.scalar('sum(llama_sidecar_restores_total{result="ok"}) / sum(llama_sidecar_restores_total)')
        assert hit_rate == pytest.approx(1.0)

        since = side.log_events("slot_restored")[0]["since_healthy"]
        median = prom.scalar("histogram_quantile(0.5, sum by (le) (llama_sidecar_restart_to_restore_seconds_bucket))")
        upper = next(b for b in BUCKETS if since <= b)
        lower = max([0.0, *(b for b in BUCKETS if b < upper)])
        assert lower <= median <= upper, (since, median)
        restore_p95 = prom.scalar(
            "histogram_quantile(0.95, sum by (le) (llama_sidecar_restore_duration_seconds_bucket))"
        )
        assert 0 < restore_p95 <= 1.0

        cached = _server_counter(server.url, "llamacpp:prompt_tokens_cached_total")
        prefilled = _server_counter(server.url, "llamacpp:prompt_tokens_total")
        assert cached >= 1000  # the restored conversation was reused
        ratio = prom.scalar(
            "sum(llamacpp:prompt_tokens_cached_total) / "
            "(sum(llamacpp:prompt_tokens_cached_total) + sum(llamacpp:prompt_tokens_total))"
        )
        assert ratio == pytest.approx(cached / (cached + prefilled))

        assert prom.scalar("llama_sidecar_disk_used_bytes") == on_disk
        assert prom.scalar("llama_sidecar_snapshot_files") == len(list(slot_dir.glob("slot*.json")))
        stats = os.statvfs(slot_dir)
        free = stats.f_bavail * stats.f_frsize
        assert abs(prom.scalar("llama_sidecar_disk_free_bytes") - free) < 0.02 * free + (64 << 20)

        variables = {"job": "llama-kv-sidecar", "server_job": "llama-server"}
        results = promql.query_all(prom.url, promql.dashboard_expressions(variables))
        # A plain llama-server has no model_* series: the router-mode row stays empty here (its
        # queries run above, without error; tests/deploy checks they return data from a router's page).
        empty = [expr for expr, result in results.items() if not result and "llama_sidecar_model_" not in expr]
        assert not empty, f"dashboard queries without data after a real restart and restore: {empty}"
        promql.query_all(prom.url, promql.annotation_expressions(variables))
        promql.query_all(prom.url, promql.rule_expressions())


def test_promtool_accepts_the_sidecar_exposition(llama: MakeServer, sidecar: MakeSidecar, slot_dir: Path) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is not installed: apt-get install -y prometheus"
    server = llama(slot_dir=slot_dir)
    side = sidecar(server, slot_dir)
    side.wait_for(lambda: side.metric("llama_sidecar_server_up") == 1, what="server up")
    code, text = side.get("/metrics")
    assert code == 200
    check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
