"""Every PromQL expression of the dashboards and alert rules, ready to run.

Grafana expressions contain dashboard variables (`$job`, `$__range`, ...)
that Prometheus cannot parse; `dashboard_expressions()` substitutes concrete
values, and `query_all()` runs expressions through Prometheus's HTTP API and
raises on the first error. `metric_names()` lists the metric names an
expression reads, to compare them with what a target actually exposes.

Used by tests/deploy/test_deploy_promql.py against a Prometheus that scrapes a
synthetic exposition, and reusable against a real sidecar and llama-server.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS = REPO / "grafana" / "dashboards"
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"

#: Values for Grafana's built-in interval variables and the dashboard's own
#: variables. Multi-value variables are used as regexes (`=~"$instance"`), so
#: ".+" stands for "All".
DEFAULT_VARIABLES: Mapping[str, str] = {
    "__range": "1h",
    "__range_s": "3600",
    "__range_ms": "3600000",
    "__rate_interval": "1m",
    "__interval": "15s",
    "__interval_ms": "15000",
    "job": "llama-kv-sidecar",
    "instance": ".+",
    "server_job": "llama-server",
    "server_instance": ".+",
    "model": ".*",
}

# $name, ${name}, ${name:format} and the deprecated [[name]].
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")


class PromQLError(Exception):
    """A query that Prometheus rejected or answered with warnings."""


def substitute(expr: str, variables: Mapping[str, str]) -> str:
    """Replace Grafana variables in `expr`; an unknown variable is an error."""

    def value(match: re.Match[str]) -> str:
        name = next(group for group in match.groups() if group is not None)
        if name not in variables:
            msg = f"no value for Grafana variable ${name} in {expr!r}"
            raise KeyError(msg)
        return variables[name]

    return _VARIABLE.sub(value, expr)


def _panels(panels: Iterable[Mapping[str, Any]]) -> Iterator[Mapping[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # panels inside rows


def _dashboards(directory: Path) -> list[Mapping[str, Any]]:
    files = sorted(directory.glob("*.json"))
    if not files:
        msg = f"no dashboard JSON files in {directory}"
        raise FileNotFoundError(msg)
    return [json.loads(path.read_text(encoding="utf-8")) for path in files]


def dashboard_expressions(
    variables: Mapping[str, str] | None = None,
    *,
    directory: Path = DASHBOARDS,
) -> list[str]:
    """`targets[].expr` of every panel of every dashboard, variables substituted.

    `variables` is merged over DEFAULT_VARIABLES.
    """
    values = {**DEFAULT_VARIABLES, **(variables or {})}
    return [
        substitute(target["expr"], values)
        for dashboard in _dashboards(directory)
        for panel in _panels(dashboard.get("panels", []))
        for target in panel.get("targets", [])
        if "expr" in target
    ]


def annotation_expressions(
    variables: Mapping[str, str] | None = None,
    *,
    directory: Path = DASHBOARDS,
) -> list[str]:
    """The PromQL of every dashboard annotation query, variables substituted."""
    values = {**DEFAULT_VARIABLES, **(variables or {})}
    return [
        substitute(annotation["target"]["expr"], values)
        for dashboard in _dashboards(directory)
        for annotation in dashboard.get("annotations", {}).get("list", [])
        if "expr" in annotation.get("target", {})
    ]


def rule_expressions(path: Path = ALERTS) -> list[str]:
    """`expr` of every rule in an alerting/recording rule file."""
    document = yaml.safe_load(path.read_text(encoding="utf-8"))
    return [str(rule["expr"]) for group in document["groups"] for rule in group["rules"]]


def query(prom_url: str, expr: str, *, timeout: float = 10.0) -> list[Any]:
    """Run one instant query; return `data.result`, or raise PromQLError."""
    url = f"{prom_url.rstrip('/')}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            body = json.load(response)
    except urllib.error.HTTPError as exc:  # 400/422: bad expression, with a JSON body
        try:
            body = json.load(exc)
        except ValueError:
            msg = f"{expr}\n  HTTP {exc.code} {exc.reason}"
            raise PromQLError(msg) from exc
    if body.get("status") != "success":
        msg = f"{expr}\n  {body.get('errorType', 'error')}: {body.get('error', body)}"
        raise PromQLError(msg)
    if body.get("warnings"):
        msg = f"{expr}\n  warnings: {body['warnings']}"
        raise PromQLError(msg)
    result: list[Any] = body["data"]["result"]
    return result


def query_all(prom_url: str, exprs: Iterable[str]) -> dict[str, list[Any]]:
    """Run every expression as an instant query; map each to its result.

    Raises PromQLError, naming the expression and Prometheus's error, at the
    first expression that fails to parse or evaluate or returns warnings.
    """
    return {expr: query(prom_url, expr) for expr in exprs}


# A small PromQL lexer: enough to tell metric names from functions, keywords,
# label names and durations, for metric_names().
_TOKEN = re.compile(
    r"""(?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
      |(?P<number>\d[\w.]*)
      |(?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
      |(?P<space>\s+)
      |(?P<other>.)""",
    re.VERBOSE,
)
_AGGREGATIONS = frozenset(
    [
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
        "limitk",
        "limit_ratio",
    ],
)
_KEYWORDS = _AGGREGATIONS | frozenset(
    [
        "and",
        "or",
        "unless",
        "bool",
        "offset",
        "atan2",
        "inf",
        "nan",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
    ],
)
_GROUPING = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})


def metric_names(expr: str) -> set[str]:
    """The metric names that `expr` selects (functions, labels and keywords excluded)."""
    tokens = [(m.lastgroup, m.group()) for m in _TOKEN.finditer(expr) if m.lastgroup != "space"]
    names: set[str] = set()
    braces = 0
    label_list = False  # inside the parenthesised label list after by/on/...
    for index, (kind, text) in enumerate(tokens):
        following = tokens[index + 1][1] if index + 1 < len(tokens) else ""
        if text == "{":
            braces += 1
        elif text == "}":
            braces -= 1
        elif label_list and text == ")":
            label_list = False
        elif kind == "ident" and not braces and not label_list:
            if text in _GROUPING and following == "(":
                label_list = True
            elif text not in _KEYWORDS and following != "(":
                names.add(text)
    return names
