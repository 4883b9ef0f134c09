"""The manual is held to the code: every flag, metric, alert and endpoint is documented once, under docs/.

Each test reads the code's own tables (the option table, the argparse parser, the metrics registry,
the alert rules, the HTTP app's routes) and the page that documents them, and fails on anything
missing, stale or documented twice. `mkdocs build --strict` fails on a broken link, a missing anchor
or a page left out of the site's nav.
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any, cast

import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from sidecar.app import server
from sidecar.cli import main as cli
from sidecar.cli import options, schema
from sidecar.core import config, metrics

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README_MAX_LINES = 200


def page(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


def table_rows(text: str) -> list[list[str]]:
    """The cells of every Markdown table row in ``text`` (header and divider rows included)."""
    rows = []
    for line in text.splitlines():
        if line.startswith("|") and line.rstrip().endswith("|"):
            cells = re.split(r"(?<!\\)\|", line.strip()[1:-1])
            rows.append([cell.strip() for cell in cells])
    return rows


def section(text: str, heading: str) -> str:
    """The text under ``heading`` (a whole line) up to the next heading of the same or a higher level."""
    level = len(heading) - len(heading.lstrip("#"))
    lines = text.splitlines()
    start = lines.index(heading) + 1
    end = next(
        (i for i in range(start, len(lines)) if re.match(rf"#{{1,{level}}} ", lines[i])),
        len(lines),
    )
    return "\n".join(lines[start:end])


def first_code(cell: str) -> str:
    """The command and flag of a table cell: ``--flag VALUE`` -> ``--flag``; ``ls --json`` -> ``ls --json``."""
    found = re.search(r"`([^`]+)`", cell)
    assert found, f"no `code` in {cell!r}"
    words = found.group(1).split()
    flag = next(i for i, w in enumerate(words) if w.startswith("--"))
    return " ".join(words[: flag + 1])


def pages_with(pattern: str) -> list[str]:
    """The docs/*.md pages in which ``pattern`` (a regex, multiline) matches."""
    return sorted(p.name for p in DOCS.glob("*.md") if re.search(pattern, p.read_text(encoding="utf-8"), re.M))


# ---- flags ---------------------------------------------------------------------------


def run_rows() -> dict[str, list[str]]:
    rows = table_rows(section(page("configuration.md"), "## `run`"))
    return {first_code(r[0]): r for r in rows if r[0].startswith("`--")}


def test_configuration_lists_every_run_flag_with_its_variable_and_default() -> None:
    rows = run_rows()
    run = options.of(schema.Command.RUN)
    assert set(rows) == {o.flag for o in run}, "docs/configuration.md `run` table vs the options table"
    for option in run:
        _, env, default, meaning = rows[option.flag]
        assert env == f"`{option.env}`", option.flag
        shown = option.shown_default  # as `run --help` shows it
        if shown is not None:
            assert default.startswith(f"`{shown}`"), f"{option.flag}: the code's default is {shown}, the page {default}"
        else:
            # a switch, or a default computed at start (the state dir's path, launcher mode's picks) is said in brackets
            assert default.split(" (")[0] in {"off", "none", "required"}, f"{option.flag}: no default in the code, "
            f"page {default}"
        assert meaning.endswith("."), f"{option.flag}: say what it does in a sentence"


def test_configuration_lists_every_flag_of_the_other_commands() -> None:
    rows = table_rows(section(page("configuration.md"), "## `ls`, `verify`, `gc`"))
    listed = {first_code(r[0]): r for r in rows if r[0].startswith("`") and " --" in r[0]}
    flags = {
        f"{command} {option.flag}": option
        for command in schema.Command
        if command is not schema.Command.RUN
        for option in options.of(command)
    }
    assert set(listed) == set(flags), "docs/configuration.md subcommand table vs the options table"
    for key, option in flags.items():
        _, env, default, _ = listed[key]
        assert env == (f"`{option.env}`" if option.env else ""), key
        if isinstance(option.own_default, float | int) and not isinstance(option.own_default, bool):
            assert default == f"`{option.own_default}`", f"{key}: the code's default is {option.own_default}"


def test_the_parser_is_built_from_the_options_table() -> None:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for command in schema.Command:
        actions = [a for a in sub.choices[command.value]._actions if not isinstance(a, argparse._HelpAction)]
        assert [a.option_strings[0] for a in actions] == [o.flag for o in options.of(command)], command
        for action, option in zip(actions, options.of(command), strict=True):
            assert action.help == option.help_text.replace("%", "%%"), option.flag


def test_no_flag_is_documented_outside_the_configuration_page() -> None:
    for option in options.OPTIONS:
        assert pages_with(rf"^\| `{re.escape(option.flag)}[ `]") == ["configuration.md"], option.flag


# ---- metrics and alerts ----------------------------------------------------------------


def scraped(family: Metric) -> tuple[str, str]:
    """A family's name as scraped, without the prefix, and its type: ``("snapshots_total", "counter")``."""
    name = family.name.removeprefix(f"{metrics.NAMESPACE}_")
    if family.type == "counter":
        return name + "_total", "counter"
    if family.type == "info":
        return name + "_info", "gauge"
    return name, family.type


def exported() -> dict[str, str]:
    """Every family the sidecar exports, by name as scraped: ``{"snapshots_total": "counter", ...}``."""
    registry = CollectorRegistry()
    metrics.Metrics(registry, version="test")
    return dict(scraped(family) for family in registry.collect())


def test_metrics_page_lists_every_metric_once_with_its_type() -> None:
    rows = [r for r in table_rows(section(page("metrics.md"), "## Series")) if r[0].startswith("`")]
    names = [r[0].strip("`") for r in rows]
    assert len(names) == len(set(names)), "a metric is listed twice"
    code = exported()
    assert set(names) == set(code), "docs/metrics.md vs sidecar/core/metrics.py"
    for row in rows:
        assert row[1] == code[row[0].strip("`")], row[0]
        assert row[3], f"{row[0]}: say what it means"


UNBOUNDED_LABELS = {"le", "slot", "model", "version"}
"""Labels whose values are ids or buckets, not a vocabulary the page can list."""


def test_metrics_page_names_each_label_and_each_of_its_values() -> None:
    registry = CollectorRegistry()
    metrics.Metrics(registry, version="test").init_slots(range(1))
    rows = {r[0].strip("`"): r for r in table_rows(section(page("metrics.md"), "## Series")) if r[0].startswith("`")}
    checked = 0
    for family in registry.collect():
        labels: dict[str, set[str]] = {}
        for sample in family.samples:
            for label, value in sample.labels.items():
                labels.setdefault(label, set()).add(value)
        if not labels:
            continue  # a family with no series at start (the model_* ones before a model is listed)
        name, _ = scraped(family)
        _, _, documented, meaning = rows[name]
        assert {label.strip() for label in documented.split(",") if label.strip()} == set(labels) - {"le"}, name
        for label, values in labels.items():
            if label in UNBOUNDED_LABELS:
                continue
            missing = sorted(v for v in values if not re.search(rf"\b{re.escape(v)}\b", meaning))
            assert not missing, f"{name}{{{label}}}: the page does not say what {missing} mean"
            checked += 1
    assert checked >= 10, "the label values of at least the outcome counters are checked"


def test_no_metric_is_documented_outside_the_metrics_page() -> None:
    for name in exported():
        assert pages_with(rf"^\| `{name}` \|") == ["metrics.md"], name


def test_metrics_page_lists_every_alert_rule() -> None:
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yml").read_text(encoding="utf-8"))
    alerts = {
        rule["alert"]: rule["labels"]["severity"]
        for group in rules["groups"]
        for rule in group["rules"]
        if "alert" in rule
    }
    rows = [r for r in table_rows(section(page("metrics.md"), "## Alerts")) if r[0].startswith("`")]
    assert {r[0].strip("`"): r[1] for r in rows} == alerts, "docs/metrics.md alert table vs alerts.yml"


# ---- endpoints -------------------------------------------------------------------------


def routes() -> set[str]:
    """``METHOD /path`` of every route of the sidecar's HTTP app (HEAD comes with GET)."""
    app = server.make_app(
        engines=cast(Any, None),
        snapshots=cast(Any, None),
        registry=CollectorRegistry(),
        settings=config.ServerSettings(),
        liveness=cast(Any, None),
    )
    return {f"{r.method} {r.resource.canonical}" for r in app.router.routes() if r.method != "HEAD" and r.resource}


def test_endpoints_page_has_a_section_for_every_route() -> None:
    documented = set(re.findall(r"^## `((?:GET|POST|PUT|DELETE|PATCH) /[^`]*)`$", page("endpoints.md"), re.M))
    assert documented == routes(), "docs/endpoints.md sections vs sidecar/app/server.py routes"


def test_no_endpoint_is_documented_outside_the_endpoints_page() -> None:
    for route in routes():
        assert pages_with(rf"^#+ `{re.escape(route)}`") == ["endpoints.md"], route


# ---- the pages as a whole --------------------------------------------------------------


def test_the_site_builds_with_no_broken_link_anchor_or_page_left_out(tmp_path: Path) -> None:
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": str(Path(sys.executable).parent)},
    )
    assert built.returncode == 0, built.stdout + built.stderr
    assert (tmp_path / "index.html").is_file()


def test_architecture_page_names_every_package() -> None:
    text = page("architecture.md")
    packages = sorted(p.parent.name for p in (ROOT / "sidecar").glob("*/__init__.py"))
    assert packages, "no package found under sidecar/"
    missing = [name for name in packages if f"`sidecar.{name}`" not in text]
    assert not missing, f"docs/architecture.md does not name {missing}"


def test_architecture_page_names_every_module_of_the_import_contracts() -> None:
    text = page("architecture.md")
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["importlinter"]
    modules = {
        f"{container}.{name.strip()}": name.strip()
        for contract in contracts["contracts"]
        for container in contract.get("containers", [])
        for layer in contract["layers"]
        for name in layer.split("|")
    }
    assert len(modules) > 30, "the contracts inside the packages list their modules"
    missing = sorted(full for full, name in modules.items() if f"`{name}`" not in text)
    assert not missing, f"docs/architecture.md does not name {missing}"


LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_front_files_link_only_to_files_that_exist() -> None:
    for name in ("README.md", "CHANGELOG.md", "CONTRIBUTING.md", "bench/README.md"):
        path = ROOT / name
        for target in LINK.findall(path.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            assert (path.parent / target.split("#")[0]).exists(), f"{name} links to {target}, which is not there"


def test_readme_is_a_front_page_whose_quick_start_comes_first() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= README_MAX_LINES
    first_code_block = readme.split("```sh\n", 1)[1].split("```", 1)[0]
    assert first_code_block.splitlines()[0].startswith("./scripts/demo")
    assert first_code_block.splitlines()[1].startswith("./scripts/test")
    for script in ("scripts/demo", "scripts/test"):
        assert (ROOT / script).is_file(), script


def test_the_readme_and_the_home_page_link_every_page_of_the_manual() -> None:
    pages = {p.name for p in DOCS.glob("*.md") if p.name != "index.md"}
    for front, prefix in ((ROOT / "README.md", "docs/"), (DOCS / "index.md", "")):
        linked = {target.split("#")[0] for target in LINK.findall(front.read_text(encoding="utf-8"))}
        missing = {name for name in pages if prefix + name not in linked}
        assert missing == set(), f"add these pages to the table of the manual in {front.name}"


# ---- the tests the reliability page cites --------------------------------------------

CITED = re.compile(r"(?<![\w.])(?:(?P<file>\w+\.py)::)?(?P<name>test_\w+)(?P<py>\.py)?")
"""A test cited in code: ``test_name``, ``test_file.py``, ``test_file.py::test_name`` or ``::test_name``."""


def defined_tests() -> dict[str, set[str]]:
    """Each test function under tests/ (module level or in a class), with the names of the files defining it."""
    defined: dict[str, set[str]] = {}
    for path in (ROOT / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test_"):
                defined.setdefault(node.name, set()).add(path.name)
    return defined


def test_every_test_the_reliability_page_cites_is_there() -> None:
    defined = defined_tests()
    files = {path.name for path in (ROOT / "tests").rglob("test_*.py")}
    missing = []
    for code in re.findall(r"`([^`\n]+)`", page("RELIABILITY.md")):
        for cited in CITED.finditer(code):
            name, file = cited["name"], cited["file"]
            if cited["py"]:
                if name + ".py" not in files:
                    missing.append(f"{name}.py: no such test file")
            elif name not in defined:
                missing.append(f"{name}: no such test function")
            elif file is not None and file not in defined[name]:
                missing.append(f"{file}::{name}: defined in {sorted(defined[name])}")
    assert not missing, "docs/RELIABILITY.md cites tests that are not in tests/:\n" + "\n".join(missing)
