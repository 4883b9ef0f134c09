"""The metrics table (sidecar/core/families.py) is the contract: the registry, docs/metrics.md and the deploy
tests' synthetic page (tests/deploy/exposition.py) hold exactly its names, types and labels."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from sidecar.core import families, metrics
from tests.deploy import exposition

ROOT = Path(__file__).resolve().parents[2]

Row = tuple[str, str, frozenset[str]]
"""A family as scraped: name without the prefix (counters with ``_total``), type, label names."""


def scraped(family: families.Family[Any]) -> Row:
    kind = family.kind.__name__.lower()
    labels = frozenset(each.name for each in family.labels)
    if kind == "counter":
        return family.name + "_total", kind, labels
    if kind == "info":
        return family.name + "_info", "gauge", labels | {"version"}
    return family.name, kind, labels


def table() -> set[Row]:
    return {scraped(family) for family in families.declared()}


def from_registry(registry: CollectorRegistry) -> set[Row]:
    """The families of ``registry`` as scraped, with the label names their samples carry (``le`` aside)."""
    rows = set()
    for family in registry.collect():
        name = family.name.removeprefix(f"{metrics.NAMESPACE}_")
        kind = {"info": "gauge"}.get(family.type, family.type)
        name += {"counter": "_total", "info": "_info"}.get(family.type, "")
        rows.add((name, kind, frozenset(k for s in family.samples for k in s.labels if k != "le")))
    return rows


def test_the_registry_holds_the_table_and_nothing_else() -> None:
    registry = CollectorRegistry()
    stats = metrics.Metrics(registry, version="t")
    stats.init_slots(range(1))
    stats.for_model("m")  # the model_* series exist once a router lists a model
    assert from_registry(registry) == table()


def test_every_family_has_a_one_sentence_help() -> None:
    for family in families.declared():
        assert family.help.endswith("."), family.name
        assert family.help.count(". ") == 0, f"{family.name}: one sentence; the long form goes to docs/metrics.md"


def test_the_metrics_page_lists_the_table() -> None:
    text = (ROOT / "docs" / "metrics.md").read_text(encoding="utf-8")
    rows = set()
    for line in text.splitlines():
        match = re.match(r"^\| `([a-z_]+)` \| (\w+) \|([a-z_, ]*)\|", line)
        if match:
            labels = frozenset(each.strip() for each in match[3].split(",") if each.strip())
            rows.add((match[1], match[2], labels))
    assert rows == table()


def test_the_synthetic_page_has_the_tables_families_and_only_values_the_sidecar_exports() -> None:
    page = exposition.sidecar_registry()
    assert from_registry(page) == table()
    bounded = {
        (f"{metrics.NAMESPACE}_{family.name}", each.name): set(each.values)
        for family in families.declared()
        for each in family.labels
        if each.values is not None
    }
    for family in page.collect():
        for sample in family.samples:
            for name, value in sample.labels.items():
                values = bounded.get((family.name, name))
                assert values is None or value in values, f"{family.name}{{{name}={value!r}}}"
