"""Every PromQL expression of the dashboard and alerts, run by a real Prometheus.

Prometheus (Debian's `prometheus` package) scrapes two small HTTP servers that
serve synthetic /metrics pages of the sidecar and llama-server (exposition.py),
under the job names of deploy/prometheus/prometheus.yml, and loads
deploy/prometheus/alerts.yml. After two scrapes every expression must run
without error, and every dashboard query must return data.
"""

from __future__ import annotations

import enum
import json
import socket
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from sidecar.core import metrics, outcomes
from tests.deploy import exposition
from tests.deploy.deploytools import DEPLOY, require_tool
from tests.support import promql
from tests.support.wait import wait_until

ALERTS = DEPLOY / "prometheus" / "alerts.yml"
STARTUP_TIMEOUT = 30.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a Prometheus that has scraped both synthetic targets twice."""
    binary = require_tool(
        "prometheus",
        install="apt-get install -y prometheus (Debian's package ships the server and promtool)",
    )
    tmp = tmp_path_factory.mktemp("prometheus")
    sidecar_body, sidecar_type = exposition.sidecar_page()
    server_body, server_type = exposition.llama_server_page()
    with (
        exposition.serve(sidecar_body, sidecar_type) as sidecar,
        exposition.serve(server_body, server_type) as server,
    ):
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(ALERTS)],
            "scrape_configs": [
                {"job_name": "llama-kv-sidecar", "static_configs": [{"targets": [sidecar]}]},
                {"job_name": "llama-server", "static_configs": [{"targets": [server]}]},
            ],
        }
        config_file = tmp / "prometheus.yml"
        config_file.write_text(yaml.safe_dump(config), encoding="utf-8")
        url = f"http://127.0.0.1:{_free_port()}"
        log = (tmp / "prometheus.log").open("w")
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config_file}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address={url.removeprefix('http://')}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            _wait_for_two_scrapes(url, proc, tmp / "prometheus.log")
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()


def _wait_for_two_scrapes(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    """Both jobs up, each with at least two samples of `up`."""
    expr = 'count_over_time(up{job=~"llama-kv-sidecar|llama-server"}[1m]) >= 2 and up == 1'

    def scraped() -> bool:
        try:
            return len(promql.query(url, expr)) == 2  # one series per job
        except (urllib.error.URLError, ConnectionError):
            return False  # not listening yet
        except promql.PromQLError as exc:
            if "HTTP 503" in str(exc):
                return False  # listening, but its storage is not ready yet
            raise

    def exited() -> str | None:
        return None if proc.poll() is None else f"prometheus exited {proc.returncode}:\n{log.read_text()}"

    try:
        wait_until(scraped, timeout=STARTUP_TIMEOUT, what="both targets scraped twice", every=0.2, gone=exited)
    except AssertionError as err:
        pytest.fail(f"{err}\n{log.read_text()}", pytrace=False)


@pytest.mark.prometheus
def test_dashboard_queries_run_and_return_data(prometheus: str) -> None:
    results = promql.query_all(prometheus, promql.dashboard_expressions())
    empty = [expr for expr, result in results.items() if not result]
    assert empty == [], "dashboard queries without data (a misspelt metric or label value?)"


@pytest.mark.prometheus
def test_dashboard_annotation_queries_run(prometheus: str) -> None:
    promql.query_all(prometheus, promql.annotation_expressions())


@pytest.mark.prometheus
def test_alert_expressions_run(prometheus: str) -> None:
    promql.query_all(prometheus, promql.rule_expressions())


@pytest.mark.prometheus
def test_alert_rules_evaluate_without_errors(prometheus: str) -> None:

    def evaluated() -> list[dict[str, Any]]:
        groups = _get_json(f"{prometheus}/api/v1/rules")["data"]["groups"]
        rules = [rule for group in groups for rule in group["rules"]]
        # A rule not evaluated yet reports the zero time, 0001-01-01T00:00:00Z.
        return [] if any(rule["lastEvaluation"].startswith("0001-") for rule in rules) else rules

    rules = wait_until(evaluated, timeout=STARTUP_TIMEOUT, what="every alert rule evaluated", every=0.2)
    assert len(rules) == len(promql.rule_expressions())
    assert [(rule["name"], rule.get("lastError", "")) for rule in rules if rule["health"] != "ok"] == []


def test_queries_read_only_metrics_of_the_contract() -> None:
    exposed = {
        line.split(" ")[2]
        for page, _ in (exposition.sidecar_page(), exposition.llama_server_page())
        for line in page.decode().splitlines()
        if line.startswith("# TYPE ")
    }
    # Histograms and counters are selected by their sample names.
    samples = set()
    for name in exposed:
        samples |= {name, f"{name}_bucket", f"{name}_sum", f"{name}_count", f"{name}_total"}
    used = set()
    for expr in promql.dashboard_expressions() + promql.annotation_expressions() + promql.rule_expressions():
        used |= promql.metric_names(expr)
    assert used - samples - {"up"} == set()


@pytest.mark.prometheus
def test_promql_reports_the_failing_expression(prometheus: str) -> None:
    with pytest.raises(promql.PromQLError, match=r"sum\(rate\(x\[1m\]\) by"):
        promql.query_all(prometheus, ["up", "sum(rate(x[1m]) by"])


def test_promql_refuses_unknown_grafana_variables() -> None:
    with pytest.raises(KeyError, match=r"\$nope"):
        promql.substitute('up{job="$nope"}', promql.DEFAULT_VARIABLES)


def test_metric_names_skip_functions_labels_and_keywords() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (le) (rate(a_bucket{job="x", le!="1"}[5m])))'
        " / on(instance) group_left b unless c > bool 2 and absent(d) or time()"
    )
    assert promql.metric_names(expr) == {"a_bucket", "b", "c", "d"}


def _families(registry: CollectorRegistry) -> dict[str, tuple[str, frozenset[str]]]:
    """Family name -> (type, label names of its samples, `le` excluded)."""
    return {
        family.name: (family.type, frozenset(k for s in family.samples for k in s.labels if k != "le"))
        for family in registry.collect()
    }


def test_synthetic_page_has_the_families_of_the_sidecar() -> None:
    """exposition.py must not drift from sidecar/metrics.py (names, types, labels)."""
    real = CollectorRegistry()
    stats = metrics.Metrics(real, version="0.0.0")
    stats.init_slots(range(len(exposition.SLOTS)))
    stats.for_model(exposition.MODELS[0])  # router mode's model_* series, as one model's engine makes them
    assert _families(exposition.sidecar_registry()) == _families(real)


@pytest.mark.parametrize(
    ("page_values", "vocabulary"),
    [
        (exposition.SNAPSHOT_RESULTS, outcomes.SaveResult),
        (exposition.RESTORE_RESULTS, outcomes.RestoreOutcome),
        (exposition.VERIFICATION_OUTCOMES, outcomes.Verification),
        (exposition.GC_REASONS, outcomes.GcReason),
        (exposition.CONVERSATION_SOURCES, outcomes.Source),
        (exposition.PROXY_ROUTES, outcomes.Route),
        (exposition.PROXY_OUTCOMES, outcomes.ProxyOutcome),
        (exposition.SLOT_DIR_OPERATIONS, outcomes.SlotDirOperation),
        (exposition.SERVER_EXITS, outcomes.ServerExit),
        (exposition.STORE_WRITES, outcomes.StoreWrite),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else "page",
)
def test_synthetic_page_has_every_label_value_of_the_sidecar(
    page_values: tuple[str, ...], vocabulary: type[enum.StrEnum]
) -> None:
    """A label value the sidecar can export and the page lacks is a dashboard or alert query never run on it."""
    assert sorted(page_values) == sorted(member.value for member in vocabulary)
