"""deploy/k8s: manifests validated offline by kubernetes-validate, and their wiring."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.deploytools import DEPLOY, REPO, require_tool, run

K8S = DEPLOY / "k8s"
#: The oldest Kubernetes release the manifests target; kubernetes-validate
#: 1.37.0 ships its schemas (1.34 to 1.37).
KUBERNETES_VERSION = "1.34.0"
MANIFESTS = sorted(K8S.glob("*.yaml"))


def _documents() -> dict[tuple[str, str], dict[str, Any]]:
    return {
        (doc["kind"], doc["metadata"]["name"]): doc
        for path in [*MANIFESTS, K8S / "prometheus-operator" / "podmonitor.yaml"]
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8"))
    }


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda path: path.name)
def test_kubernetes_validate_strict(manifest: Path) -> None:
    """Schema of Kubernetes KUBERNETES_VERSION; --strict rejects unknown fields."""
    validate = require_tool("kubernetes-validate", install="pip install kubernetes-validate==1.37.0")
    proc = run(
        [validate, "--strict", "--kubernetes-version", KUBERNETES_VERSION, str(manifest.relative_to(REPO))],
    )
    assert "passed" in proc.stdout
    assert "WARN" not in proc.stdout + proc.stderr


def test_pod_shares_the_slot_volume_between_server_and_sidecar() -> None:
    pod = _documents()[("Deployment", "llama-server")]["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    mounts = {
        name: {m["name"]: m["mountPath"] for m in container["volumeMounts"]} for name, container in containers.items()
    }
    assert mounts["llama-server"]["slots"] == mounts["sidecar"]["slots"] == "/slots"
    args = containers["llama-server"]["args"]
    assert args[args.index("--slot-save-path") + 1] == "/slots"
    assert "--metrics" in args
    assert "--swa-full" not in args  # sliding-window models are reused without it
    env = {e["name"]: e.get("value") for e in containers["sidecar"]["env"]}
    assert env["LLAMA_SIDECAR_SLOT_DIR"] == "/slots"
    assert env["LLAMA_SIDECAR_SERVER"] == "http://127.0.0.1:8080"
    # RAM staging: a Memory emptyDir with a size limit; the block store on a PVC, the state dir, seen by both
    # containers at one path (a save that does not fit in RAM is staged there behind a link).
    (slots,) = [v for v in pod["volumes"] if v["name"] == "slots"]
    assert slots["emptyDir"]["medium"] == "Memory"
    assert slots["emptyDir"]["sizeLimit"]
    (state,) = [v for v in pod["volumes"] if v["name"] == "state"]
    claims = {name for kind, name in _documents() if kind == "PersistentVolumeClaim"}
    assert state["persistentVolumeClaim"]["claimName"] in claims
    assert env["LLAMA_SIDECAR_STATE_DIR"] == mounts["sidecar"]["state"] == mounts["llama-server"]["state"]


def test_probes() -> None:
    pod = _documents()[("Deployment", "llama-server")]["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    assert containers["sidecar"]["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert containers["sidecar"]["readinessProbe"]["httpGet"]["path"] == "/readyz"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert containers["llama-server"][probe]["httpGet"]["path"] == "/health"


def test_server_outlives_the_sidecars_final_snapshot() -> None:
    """Containers stop in parallel: llama-server's preStop sleep must cover the final snapshot (~20 s)."""
    pod = _documents()[("Deployment", "llama-server")]["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    command = containers["llama-server"]["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    sleep = int(command[1])
    assert sleep >= 25  # the final snapshot takes up to about 20 s
    assert pod["terminationGracePeriodSeconds"] >= sleep + 30
    assert "lifecycle" not in containers["sidecar"]


def test_one_pod_at_a_time_per_slot_volume() -> None:
    spec = _documents()[("Deployment", "llama-server")]["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"]["type"] == "Recreate"


def test_service_and_monitoring_select_the_pod_and_its_named_ports() -> None:
    docs = _documents()
    template = docs[("Deployment", "llama-server")]["spec"]["template"]
    labels = template["metadata"]["labels"]
    ports = {p["name"]: p["containerPort"] for c in template["spec"]["containers"] for p in c["ports"]}
    service = docs[("Service", "llama-server")]["spec"]
    assert service["selector"].items() <= labels.items()
    assert {p["targetPort"] for p in service["ports"]} <= set(ports)
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == ports["sidecar"]
    # The PodMonitor is a custom resource: kubernetes-validate has no schema
    # for it, so its wiring is checked here instead.
    monitor = docs[("PodMonitor", "llama-server")]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    jobs = {
        endpoint["port"]: [r["replacement"] for r in endpoint["relabelings"] if r["targetLabel"] == "job"]
        for endpoint in monitor["spec"]["podMetricsEndpoints"]
    }
    assert jobs == {"sidecar": ["llama-kv-sidecar"], "http": ["llama-server"]}


def test_llama_server_image_matches_compose_and_the_sidecar_image() -> None:
    pod = _documents()[("Deployment", "llama-server")]["spec"]["template"]["spec"]
    (server,) = [c for c in pod["containers"] if c["name"] == "llama-server"]
    compose = (DEPLOY / "compose.beside.yaml").read_text(encoding="utf-8")
    assert f"x-llama-image: &llama-image {server['image']}\n" in compose
    assert f"ARG LLAMA_IMAGE={server['image']}\n" in (DEPLOY / "Dockerfile").read_text(encoding="utf-8")


def test_service_sends_clients_to_the_proxy_even_while_the_pod_is_not_ready() -> None:
    docs = _documents()
    containers = {c["name"]: c for c in docs[("Deployment", "llama-server")]["spec"]["template"]["spec"]["containers"]}
    sidecar = containers["sidecar"]
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    assert int(env["LLAMA_SIDECAR_PROXY_LISTEN"].rpartition(":")[2]) == ports["proxy"]
    service = docs[("Service", "llama-server")]["spec"]
    assert {p["port"]: p["targetPort"] for p in service["ports"]}[8080] == "proxy"
    assert service["publishNotReadyAddresses"] is True


SHARED = K8S / "shared-store" / "statefulset.yaml"


def test_shared_store_example_validates_and_shares_one_bucket() -> None:
    validate = require_tool("kubernetes-validate", install="pip install kubernetes-validate==1.37.0")
    proc = run([validate, "--strict", "--kubernetes-version", KUBERNETES_VERSION, str(SHARED.relative_to(REPO))])
    assert "WARN" not in proc.stdout + proc.stderr
    assert proc.stdout.count("passed") == 2
    sts = next(d for d in yaml.safe_load_all(SHARED.read_text(encoding="utf-8")) if d["kind"] == "StatefulSet")
    assert sts["spec"]["replicas"] == 2
    assert [t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]] == ["slots"]  # one slot dir per pod
    sidecar = next(c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "sidecar")
    env = {e["name"]: e for e in sidecar["env"]}
    assert env["LLAMA_SIDECAR_SHARED_STORE"]["value"].startswith("s3://")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert "secretKeyRef" in env[name]["valueFrom"], f"{name} must come from a Secret"
