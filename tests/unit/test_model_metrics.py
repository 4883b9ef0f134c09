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


def test_the_series_of_slots_that_are_gone_are_removed() -> None:
    registry = CollectorRegistry()
    stats = metrics.Metrics(registry, version="t")
    stats.init_slots(range(4))
    stats.snapshots.labels("3", "ok").inc()
    stats.restored_tokens.labels("3").inc(100)
    stats.unsaved_since.labels("2").set(1.0)
    stats.init_slots(range(2))  # the server came back with -np 2
    for slot in ("2", "3"):
        assert value(registry, "llama_sidecar_snapshots_total", slot=slot, result="ok") is None
        assert value(registry, "llama_sidecar_restores_total", slot=slot, result="failed") is None
        assert value(registry, "llama_sidecar_restored_tokens_total", slot=slot) is None
        assert value(registry, "llama_sidecar_slot_unsaved_since_timestamp_seconds", slot=slot) is None
    assert value(registry, "llama_sidecar_snapshots_total", slot="1", result="ok") == 0
    assert value(registry, "llama_sidecar_restored_tokens_total", slot="1") == 0


def test_in_router_mode_the_slots_of_the_model_with_the_most_are_kept() -> None:
    registry = CollectorRegistry()
    stats = metrics.Metrics(registry, version="t")
    alpha, beta = stats.for_model("alpha"), stats.for_model("beta")
    alpha.init_slots(range(4))
    alpha.snapshots.labels("3", "ok").inc()
    beta.init_slots(range(2))  # the series are shared: alpha's slots 2 and 3 stay
    assert value(registry, "llama_sidecar_snapshots_total", slot="3", result="ok") == 1
    alpha.init_slots(range(1))
    assert value(registry, "llama_sidecar_snapshots_total", slot="3", result="ok") is None
    assert value(registry, "llama_sidecar_snapshots_total", slot="1", result="ok") == 0
