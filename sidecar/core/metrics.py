"""Every metric the sidecar exports, built against an injected registry from the table in ``families``.

Labels take bounded values only: slot ids and a handful of result words, each
pre-initialised so no series is missing when Prometheus first scrapes; the
series of slots and router models that are gone are removed. llama-server's
own counters are not re-exported: scrape its /metrics directly.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from sidecar.core import events, families, outcomes

NAMESPACE = families.NAMESPACE
SNAPSHOT_RESULTS = tuple(r.value for r in outcomes.SaveResult)
RESTORE_RESULTS = tuple(r.value for r in outcomes.RestoreOutcome)
GC_REASONS = tuple(r.value for r in outcomes.GcReason)
SLOTS_RETRY_ANSWERS = tuple(a.value for a in outcomes.SlotsRetry)
SHARED_OPERATIONS = tuple(o.value for o in outcomes.SharedOperation)


class Metrics(families.Families):
    """The table's families built in one registry, with the series of slots and router models as they come and go."""

    def __init__(self, registry: CollectorRegistry, *, version: str) -> None:
        for family in families.declared():
            setattr(self, family.attr, family.build(registry))
        self.build_info.info({"version": version})
        self.server_readable.set(1)
        self.model: str | None = None
        """The router-mode model this view counts for (see :meth:`for_model`); None for a plain server."""
        self._slot_counts: dict[str | None, int] = {}
        """Slots of each model (None: a plain server), as :meth:`init_slots` was last told."""

    def for_model(self, model: str) -> Metrics:
        """The metrics one model's engine writes in router mode (see :class:`ModelMetrics`)."""
        return ModelMetrics(self, model)

    def forget_model(self, model: str) -> None:
        """Drop a model's ``model_*`` series once the router no longer lists it."""
        self.model_up.remove(model)
        for result in SNAPSHOT_RESULTS:
            self.model_snapshots.remove(model, result)
        for result in RESTORE_RESULTS:
            self.model_restores.remove(model, result)

    def memory_is(self, kind: events.Memory) -> None:
        """The served model's memory kind (``model_memory_info``)."""
        for each in events.Memory:
            self.model_memory.labels(each.value).set(1 if each is kind else 0)

    def count_model(self, counter: Counter, result: str) -> None:
        """Count one outcome in a ``model_*`` counter, in a :meth:`for_model` view only."""
        if self.model is not None:
            counter.labels(self.model, result).inc()

    def init_slots(self, slot_ids: range) -> None:
        """Create every (slot, result) series at zero once the slot count is known; remove those of slots gone.

        A server restarted with fewer slots leaves the series of the others behind, each one a line of
        every scrape: they are removed. In router mode the per-slot series are shared by the models, so
        the slots of the model with the most are kept.
        """
        self._slot_counts[self.model] = len(slot_ids)
        kept = max(self._slot_counts.values())
        for slot in range(kept):
            label = str(slot)
            for result in SNAPSHOT_RESULTS:
                self.snapshots.labels(label, result)
            for result in RESTORE_RESULTS:
                self.restores.labels(label, result)
            self.restored_tokens.labels(label)
            self.unsaved_since.labels(label)
            self.unsaved_reprefill.labels(label)
            self.save_expected_stall.labels(label)
        for family, names in (
            (self.snapshots, ("slot", "result")),
            (self.restores, ("slot", "result")),
            (self.restored_tokens, ("slot",)),
            (self.unsaved_since, ("slot",)),
            (self.unsaved_reprefill, ("slot",)),
            (self.save_expected_stall, ("slot",)),
        ):
            gone = {
                tuple(sample.labels[name] for name in names)
                for collected in family.collect()
                for sample in collected.samples
                if not (sample.labels["slot"].isdigit() and int(sample.labels["slot"]) < kept)
            }
            for values in gone:
                family.remove(*values)


class ModelMetrics(Metrics):
    """One router-mode model's view of the families: shared series, plus its ``model_*`` ones.

    Made by :meth:`Metrics.for_model` over the process's one :class:`Metrics`;
    nothing is registered again. The unlabelled and per-slot series are the
    shared ones (they sum over the models); ``server_up`` becomes
    ``model_up{model}`` (the router's /health is not the model's), and
    :meth:`count_model` counts in the model's series.
    """

    def __init__(self, shared: Metrics, model: str) -> None:  # the families are the shared ones: not built again
        self._shared = shared
        self.model = model
        self.server_up = shared.model_up.labels(model)
        for result in SNAPSHOT_RESULTS:
            shared.model_snapshots.labels(model, result)
        for result in RESTORE_RESULTS:
            shared.model_restores.labels(model, result)

    def __getattr__(self, name: str) -> object:
        """Every family this view does not replace is the shared object's (looked up at each use)."""
        if name == "_shared":
            raise AttributeError(name)
        return getattr(self._shared, name)
