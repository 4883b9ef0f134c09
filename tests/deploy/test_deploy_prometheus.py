"""deploy/prometheus: scrape config and alert rules, checked and unit-tested by promtool."""

from __future__ import annotations

import yaml

from tests.deploy.deploytools import DEPLOY, require_tool, run

PROMETHEUS = DEPLOY / "prometheus"
INSTALL = "apt-get install -y prometheus (Debian's package ships promtool)"


def test_promtool_check_config() -> None:
    promtool = require_tool("promtool", install=INSTALL)
    run([promtool, "check", "config", "prometheus.yml"], cwd=PROMETHEUS)


def test_promtool_check_rules() -> None:
    promtool = require_tool("promtool", install=INSTALL)
    run([promtool, "check", "rules", "alerts.yml"], cwd=PROMETHEUS)


def test_promtool_test_rules() -> None:
    promtool = require_tool("promtool", install=INSTALL)
    proc = run([promtool, "test", "rules", "alerts_test.yml"], cwd=PROMETHEUS)
    assert "SUCCESS" in proc.stdout


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    rules = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text(encoding="utf-8"))
    tests = yaml.safe_load((PROMETHEUS / "alerts_test.yml").read_text(encoding="utf-8"))
    alerts = {rule["alert"] for group in rules["groups"] for rule in group["rules"] if "alert" in rule}
    cases = [case for test in tests["tests"] for case in test.get("alert_rule_test", [])]
    fired = {case["alertname"] for case in cases if case["exp_alerts"]}
    quiet = {case["alertname"] for case in cases if not case["exp_alerts"]}
    assert alerts - fired == set(), "alerts never expected to fire"
    assert alerts - quiet == set(), "alerts never expected to stay quiet"


def test_every_alert_says_what_happened_and_what_to_do() -> None:
    rules = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text(encoding="utf-8"))
    for group in rules["groups"]:
        for rule in group["rules"]:
            assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
            assert set(rule["annotations"]) >= {"summary", "description"}, rule["alert"]


def test_scrape_jobs_have_the_names_the_alerts_and_dashboard_expect() -> None:
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text(encoding="utf-8"))
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"llama-kv-sidecar", "llama-server"}
    assert jobs["llama-kv-sidecar"]["static_configs"][0]["targets"] == ["sidecar:9464"]
    # llama-server through the proxy, which forwards /metrics: the same target in launcher and beside mode.
    assert jobs["llama-server"]["static_configs"][0]["targets"] == ["sidecar:8080"]
    assert config["rule_files"] == ["alerts.yml"]
