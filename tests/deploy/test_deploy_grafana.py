"""grafana/: the dashboard, type-checked against @grafana/schema, and its provisioning."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from tests.deploy.deploytools import GRAFANA, REPO, require_tool, run

CHECKER = REPO / "tests" / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "llama-kv-sidecar.json"


def _panels(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [p for panel in panels for p in [panel, *_panels(panel.get("panels", []))]]


def test_dashboard_matches_grafana_schema() -> None:
    """`npm run check`: embed.mjs + tsc against @grafana/schema (see check.ts)."""
    npm = require_tool("npm", install="apt-get install -y nodejs npm")
    tsc = CHECKER / "node_modules" / ".bin" / "tsc"
    assert tsc.exists(), (
        f"{tsc.relative_to(REPO)} is missing: run `npm ci` in {CHECKER.relative_to(REPO)} "
        "(or `bash deploy/check-tools.sh`)"
    )
    run([npm, "run", "--silent", "check"], cwd=CHECKER)


def test_every_panel_uses_the_datasource_variable() -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for panel in _panels(dashboard["panels"]):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"], panel["title"]


def test_panel_ids_are_unique_and_panels_do_not_overlap() -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    panels = _panels(dashboard["panels"])
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids))
    cells: dict[tuple[int, int], str] = {}
    for panel in panels:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]  # Grafana's grid is 24 columns wide
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


def test_job_and_instance_variables_come_from_the_datasource() -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    for name in ("job", "instance", "server_job", "server_instance"):
        assert variables[name]["type"] == "query"
        assert variables[name]["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert variables[name]["query"].startswith("label_values(")


def test_provisioning_points_at_the_mounted_dashboards() -> None:
    compose = yaml.safe_load((REPO / "deploy" / "compose.yaml").read_text(encoding="utf-8"))
    mounts = dict(volume.split(":")[:2] for volume in compose["services"]["grafana"]["volumes"])
    providers = yaml.safe_load(
        (GRAFANA / "provisioning" / "dashboards" / "llama-kv-sidecar.yaml").read_text(encoding="utf-8"),
    )["providers"]
    assert [provider["options"]["path"] for provider in providers] == [mounts["../grafana/dashboards"]]
    assert mounts["../grafana/provisioning"] == "/etc/grafana/provisioning"
    datasources = yaml.safe_load(
        (GRAFANA / "provisioning" / "datasources" / "prometheus.yaml").read_text(encoding="utf-8"),
    )["datasources"]
    assert [(d["type"], d["url"], d["isDefault"]) for d in datasources] == [
        ("prometheus", "http://prometheus:9090", True),
    ]
    home = compose["services"]["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert Path(home).name == DASHBOARD.name
