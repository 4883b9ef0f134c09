"""The few sums of the sidecar's own metrics the status page prints, read from the registry.

Read from the same :class:`CollectorRegistry` ``/metrics`` serves, so the
page's numbers are the ones a scrape sees at that moment.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry

from sidecar.app import history
from sidecar.core import metrics
from sidecar.engine import report

_P = metrics.NAMESPACE + "_"
SUMS: Mapping[str, tuple[str, Mapping[str, str]]] = {
    "prefill_saved_seconds": (_P + "prefill_saved_seconds_total", {}),
    "prefill_saved_tokens": (_P + "prefill_saved_tokens_total", {}),
    "restores_ok": (_P + "restores_total", {"result": "ok"}),
    "restores": (_P + "restores_total", {}),
    "verified_effective": (_P + "restore_verifications_total", {"outcome": "effective"}),
    "verified_ineffective": (_P + "restore_verifications_total", {"outcome": "ineffective"}),
    "swaps": (_P + "swap_duration_seconds_count", {}),
    "snapshots_ok": (_P + "snapshots_total", {"result": "ok"}),
    "restarts": (_P + "server_restarts_total", {}),
}
"""Figure key -> (sample name, labels it must have): the sum over every series that matches."""


def read(registry: CollectorRegistry, status: report.Status) -> dict[str, float]:
    """Every figure of :data:`SUMS`, plus llama-server's own prompt token counters as last polled."""
    found = dict.fromkeys(SUMS, 0.0)
    wanted: dict[str, list[tuple[str, Mapping[str, str]]]] = {}
    for key, (name, labels) in SUMS.items():
        wanted.setdefault(name, []).append((key, labels))
    for family in registry.collect():
        for sample in family.samples:
            for key, labels in wanted.get(sample.name, ()):
                if all(sample.labels.get(k) == v for k, v in labels.items()):
                    found[key] += sample.value
    obs = status.observation
    if obs is not None and obs.counters is not None:
        found["server_prompt_tokens"] = obs.counters.prompt_tokens
        found["server_cached_tokens"] = obs.counters.cached_tokens
    return found


def sample(registry: CollectorRegistry, status: report.Status, *, at: float) -> history.Sample:
    f = read(registry, status)
    return history.Sample(
        at=at,
        restores=f["restores_ok"],
        saved_seconds=f["prefill_saved_seconds"],
        prompt_tokens=f.get("server_prompt_tokens"),
        cached_tokens=f.get("server_cached_tokens"),
    )
