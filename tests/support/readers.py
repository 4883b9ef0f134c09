"""Reading what a process exposes: Prometheus text and JSON log lines."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
"""Every sample of one exposition, by (name, labels)."""


def parse_metrics(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name, frozenset(sample.labels.items())] = float(sample.value)
    return out


def sample(samples: Samples, name: str, **labels: str) -> float:
    """The sum of the samples called `name` whose labels include `labels` (0.0 when none)."""
    wanted = set(labels.items())
    return sum(value for (found, have), value in samples.items() if found == name and wanted <= have)


def has_sample(samples: Samples, name: str) -> bool:
    return any(found == name for found, _ in samples)


def scrape(url: str, timeout: float = 5.0) -> Samples:
    """GET `url` (a /metrics endpoint) and parse it."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return parse_metrics(resp.read().decode())


def json_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON objects among the lines of a log file (other lines are skipped)."""
    out: list[dict[str, Any]] = []
    text = path.read_text(errors="replace") if path.exists() else ""
    for line in text.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict):
            out.append(entry)
    return out
