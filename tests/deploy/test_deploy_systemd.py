"""deploy/systemd: the unit, checked by `systemd-analyze verify` and against its env file.

`systemd-analyze verify` loads the unit with systemd's own parser and reports
unknown keys, bad values and missing dependencies. It also requires the
ExecStart binary to exist, so the check runs on a copy whose ExecStart points
at /bin/true, beside a stub llama-server.service.
"""

from __future__ import annotations

import os
from pathlib import Path

from sidecar.cli import main, parsing
from sidecar.core import config
from sidecar.launch import argv
from sidecar.proxy import conns
from tests.deploy.deploytools import DEPLOY, require_tool, run

UNIT = DEPLOY / "systemd" / "llama-kv-sidecar.service"
ENV_EXAMPLE = DEPLOY / "systemd" / "llama-kv-sidecar.env.example"
EXEC = "/opt/llama-kv-sidecar/bin/llama-kv-sidecar"


def _directives(text: str) -> dict[str, list[str]]:
    """`Section.Key` → values, in order (systemd allows repeated keys)."""
    directives: dict[str, list[str]] = {}
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, sep, value = line.partition("=")
        assert sep == "=", f"not a directive: {raw!r}"
        assert section, f"directive outside a section: {raw!r}"
        directives.setdefault(f"{section}.{key}", []).append(value)
    return directives


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = require_tool("systemd-analyze", install="apt-get install -y systemd")
    text = UNIT.read_text(encoding="utf-8")
    assert f"ExecStart={EXEC} run\n" in text
    (tmp_path / UNIT.name).write_text(text.replace(EXEC, "/bin/true"), encoding="utf-8")
    (tmp_path / "llama-server.service").write_text(
        "[Unit]\nDescription=stub llama-server\n\n[Service]\nExecStart=/bin/true\n",
        encoding="utf-8",
    )
    # A trailing ":" appends systemd's default unit directories (for sysinit.target etc.).
    env = {**os.environ, "SYSTEMD_UNIT_PATH": f"{tmp_path}:"}
    proc = run([analyze, "verify", str(tmp_path / UNIT.name)], env=env)
    assert proc.stdout + proc.stderr == "", "systemd-analyze verify reported problems"


def test_unit_is_ordered_against_llama_server() -> None:
    unit = _directives(UNIT.read_text(encoding="utf-8"))
    assert "llama-server.service" in unit["Unit.After"][0].split()
    assert unit["Unit.PartOf"] == ["llama-server.service"]
    assert "Unit.BindsTo" not in unit  # would stop the sidecar when llama-server crashes
    assert unit["Install.WantedBy"] == ["llama-server.service"]
    timeout = unit["Service.TimeoutStopSec"][0]
    assert timeout.endswith("s"), timeout
    assert int(timeout[:-1]) >= 25, "the final snapshot takes up to about 20 s"


def test_unit_gives_the_proxy_file_descriptors_for_its_connection_cap() -> None:
    unit = _directives(UNIT.read_text(encoding="utf-8"))
    needed = 2 * config.ProxySettings().max_connections + conns.FD_RESERVE
    assert int(unit["Service.LimitNOFILE"][0]) >= needed, "systemd's default 1,024 cannot hold the proxy's cap"


def test_unit_is_hardened_and_may_write_only_the_slot_dir() -> None:
    unit = _directives(UNIT.read_text(encoding="utf-8"))
    env = _directives("[Env]\n" + ENV_EXAMPLE.read_text(encoding="utf-8"))
    assert unit["Service.ProtectSystem"] == ["strict"]
    assert unit["Service.NoNewPrivileges"] == ["true"]
    assert unit["Service.ReadWritePaths"] == env["Env.LLAMA_SIDECAR_SLOT_DIR"]
    assert unit["Service.EnvironmentFile"] == ["/etc/llama-kv-sidecar/llama-kv-sidecar.env"]


LAUNCHER_UNIT = DEPLOY / "systemd" / "llama-kv-sidecar-launcher.service"


def test_the_launcher_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = require_tool("systemd-analyze", install="apt-get install -y systemd")
    text = LAUNCHER_UNIT.read_text(encoding="utf-8")
    assert f"ExecStart={EXEC} run " in text
    (tmp_path / LAUNCHER_UNIT.name).write_text(text.replace(EXEC, "/bin/true"), encoding="utf-8")
    env = {**os.environ, "SYSTEMD_UNIT_PATH": f"{tmp_path}:"}
    proc = run([analyze, "verify", str(tmp_path / LAUNCHER_UNIT.name)], env=env)
    assert proc.stdout + proc.stderr == "", "systemd-analyze verify reported problems"


def test_the_launcher_units_command_is_accepted_by_the_sidecar() -> None:
    """ExecStart's arguments parse, and the llama-server arguments pass the launcher's checks."""
    unit = _directives(LAUNCHER_UNIT.read_text(encoding="utf-8"))
    words = unit["Service.ExecStart"][0].split()
    assert words[:2] == [EXEC, "run"]
    ours, command = main._split(words[2:])
    assert command is not None
    ns = main.build_parser().parse_args(["run", *ours])
    settings = parsing.settings_from(ns, launching=True)
    # The one command: no slot dir given (RAM staging), the state dir is systemd's StateDirectory=.
    assert settings.snapshots.slot_dir == parsing.PENDING_SLOT_DIR
    state = "/var/lib/" + unit["Service.StateDirectory"][0]
    assert unit["Service.Environment"] == [f"LLAMA_SIDECAR_STATE_DIR={state}"]
    assert unit["Service.ReadWritePaths"] == [state]
    launch = argv.plan(command, slot_dir=Path("/dev/shm/x"), proxy=True, port=1, sidecar_has_key=False)
    assert "--slot-save-path" in launch.added
    assert launch.listen == (("127.0.0.1",), 8080), "the proxy takes llama-server's own address"
    timeout = int(unit["Service.TimeoutStopSec"][0].removesuffix("s"))
    assert timeout > config.SnapshotSettings(slot_dir=Path()).final_timeout + 10, "saves, then llama-server's stop"
