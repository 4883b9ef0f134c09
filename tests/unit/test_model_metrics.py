"""metrics.Metrics.for_model: router mode's per-model series beside the shared ones."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from sidecar.core import metrics


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_a_model_view_counts_in_the_shared_series_and_in_its_models() -> None:
    registry = CollectorRegistry()
    stats = metrics.Metrics(registry, version="t")
    alpha, beta = stats.for_model("alpha"), stats.for_model("beta")
    alpha.snapshots.labels("0", "ok").inc()
    alpha.count_model(alpha.model_snapshots, "ok")
    beta.snapshots.labels("0", "ok").inc()
    beta.count_model(beta.model_snapshots, "ok")
    beta.count_model(beta.model_restores, "failed")
    assert value(registry, "llama_sidecar_snapshots_total", slot="0", result="ok") == 2
    assert value(registry, "llama_sidecar_model_snapshots_total", model="alpha", result="ok") == 1
    assert value(registry, "llama_sidecar_model_restores_total", model="beta", result="failed") == 1
    assert value(registry, "llama_sidecar_model_restores_total", model="alpha", result="ok") == 0


def test_a_models_up_gauge_is_its_own_and_the_plain_view_counts_no_model() -> None:
    registry = CollectorRegistry()
    stats = metrics.Metrics(registry, version="t")
    alpha = stats.for_model("alpha")
    alpha.server_up.set(1)
    stats.server_up.set(0)
    stats.count_model(stats.model_snapshots, "ok")
    assert value(registry, "llama_sidecar_model_up", model="alpha") == 1
    assert value(registry, "llama_sidecar_server_up") == 0
    assert value(registry, "llama_sidecar_model_snapshots_total", model="alpha", result="ok") == 0


def test_a_forgotten_model_leaves_no_series() -> None:
    registry = CollectorRegistry()
    stats = metrics.Metrics(registry, version="t")
    stats.for_model("alpha").server_up.set(1)
    stats.forget_model("alpha")
    assert value(registry, "llama_sidecar_model_up", model="alpha") is None
    assert value(registry, "llama_sidecar_model_snapshots_total", model="alpha", result="ok") is None
