"""Security: admin endpoints, the listen default, the API key, hostile manifests, file modes."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import aiohttp
import pytest

from sidecar.cli import main as cli
from tests.support.fakellama import FakeLlama, MakeFake, Reply
from tests.support.faultbed import Sidecar, make_settings, run_sidecar
from tests.support.sidecarbed import SidecarProcess
from tests.support.wait import eventually, until

ADMIN = "admin-Zq8w3Xv1-a7Rk"
API_KEY = "sk-llama-7f3c9b1d2e4a"
STAMP = "20240101T000000000000Z"


@pytest.mark.timeout(20)
async def test_admin_endpoints_are_off_without_admin_token(fake: FakeLlama, slot_dir: Path) -> None:
    fake.use(0, 300)
    async with run_sidecar(make_settings(fake.url, slot_dir, min_tokens=100_000)) as car:
        await eventually(lambda: car.metric("server_up"), what="server_up 1")
        await eventually(lambda: _status_has_slots(car), what="slots read")
        for path in ("/snapshot?slot=0", "/restore"):
            for headers in ({}, {"Authorization": "Bearer anything"}, {"Authorization": "Bearer "}):
                code, body = await car.request("POST", path, headers=headers)
                assert code == 403, (path, headers, body)
                assert "--admin-token" in body
        assert not [s for s in fake.saves if s.slot == 0], "a refused POST /snapshot reached the server"
        assert not fake.restores


@pytest.mark.timeout(20)
async def test_admin_endpoints_need_the_bearer_token(fake: FakeLlama, slot_dir: Path) -> None:
    fake.use(0, 300)
    async with run_sidecar(make_settings(fake.url, slot_dir, admin_token=ADMIN, min_tokens=100_000)) as car:
        await eventually(lambda: car.metric("server_up"), what="server_up 1")
        await eventually(lambda: _status_has_slots(car), what="slots read")
        wrong: list[dict[str, str]] = [
            {},
            {"Authorization": ""},
            {"Authorization": "Bearer "},
            {"Authorization": "Bearer wrong-token"},
            {"Authorization": f"Bearer {ADMIN}x"},
            {"Authorization": f"Bearer {ADMIN[:-1]}"},
            {"Authorization": f"Basic {ADMIN}"},
        ]
        codes = []
        for path in ("/snapshot?slot=0", "/restore"):
            for headers in wrong:
                code, body = await car.request("POST", path, headers=headers)
                assert code in (401, 429), (path, headers, body)  # 429: past 5 wrong tries, the address waits
                codes.append(code)
        assert codes[:6] == [401] * 6
        assert not [s for s in fake.saves if s.slot == 0], "an unauthorized POST /snapshot reached the server"
        assert not fake.restores

        right = {"Authorization": f"Bearer {ADMIN}"}
        found = await eventually(lambda: _read(car, "POST", "/snapshot?slot=0", right), what="the wait over")
        assert found is not None
        code, body = found
        assert code == 200, body
        assert json.loads(body)["ok"] is True
        assert await car.metric("snapshots_total", slot="0", result="ok") == 1
        code, body = await car.request("POST", "/restore", headers=right)
        assert code == 200, body
        assert "results" in json.loads(body)


@pytest.mark.timeout(20)
async def test_admin_slot_parameter_takes_ascii_digits_only(fake: FakeLlama, slot_dir: Path) -> None:
    fake.use(0, 300)
    async with run_sidecar(make_settings(fake.url, slot_dir, admin_token=ADMIN, min_tokens=100_000)) as car:
        await eventually(lambda: _status_has_slots(car), what="slots read")
        right = {"Authorization": f"Bearer {ADMIN}"}
        # superscript two, Arabic-Indic zero, Extended Arabic-Indic one, fullwidth zero, and ASCII look-alikes
        for spelled in ("%C2%B2", "%D9%A0", "%DB%B1", "%EF%BC%90", "1_0", "+0", "-0", "%200", "0x", ""):
            code, body = await car.request("POST", f"/snapshot?slot={spelled}", headers=right)
            assert code == 400, (spelled, code, body)
            assert "?slot=N" in body
        assert not [s for s in fake.saves if s.slot == 0], "a slot number in other digits reached the server"
        code, body = await car.request("POST", "/snapshot?slot=0", headers=right)
        assert code == 200, body
        assert len([s for s in fake.saves if s.slot == 0]) == 1


def test_default_listen_is_loopback(tmp_path: Path) -> None:
    settings = cli.settings_from(cli.build_parser().parse_args(["run", "--slot-dir", str(tmp_path)]))
    assert (settings.server.host, settings.server.port) == ("127.0.0.1", 9464)
    assert settings.server.admin_token is None


@pytest.mark.timeout(40)
async def test_api_key_is_sent_and_never_shown(make_fake: MakeFake, slot_dir: Path, tmp_path: Path) -> None:
    fake = make_fake(api_key=API_KEY)
    fake.use(0, 300)
    proc = SidecarProcess(
        fake.url,
        slot_dir,
        tmp_path / "sidecar.log",
        extra={
            "--api-key": API_KEY, "--admin-token": ADMIN, "--poll-interval": "0.05", "--idle-seconds": "0",
            "--min-tokens": "10", "--request-timeout": "0.5", "--log-level": "debug",
        },
    )  # fmt: skip
    try:
        url = proc.start().url
        await until(lambda: list(slot_dir.glob("slot0-*.json")), timeout=10, what="a committed snapshot of slot 0")
        # Failures log the server's replies: make some, to check that none carries the key.
        refused = Reply.error(401, "Invalid API Key")
        fake.replies["/props"] = fake.replies["/metrics"] = fake.replies["save"] = refused
        fake.use(0, 400)
        await until(lambda: len(fake.requests("save")) >= 3, timeout=10, what="a refused save")
        fake.replies.clear()
        async with aiohttp.ClientSession() as session:
            shown = []
            for path in ("/status", "/metrics", "/readyz", "/healthz"):
                async with session.get(url + path) as resp:
                    shown.append(await resp.text())
    finally:
        proc.terminate(15)

    for endpoint in ("/slots", "/props", "/metrics", "save"):
        seen = fake.requests(endpoint)
        assert seen, f"the sidecar never called {endpoint}"
        assert {s.auth for s in seen} == {f"Bearer {API_KEY}"}, (endpoint, {s.auth for s in seen})
    lines = proc.lines()
    assert any('"snapshot_committed"' in line for line in lines)
    assert any('"snapshot_failed"' in line for line in lines)
    leaked = [line for line in lines if API_KEY in line or ADMIN in line]
    assert not leaked, leaked
    for body in shown:
        assert API_KEY not in body
        assert ADMIN not in body


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    "named",
    ["../../etc/passwd", "/etc/passwd", f"sub/slot0-{STAMP}.bin", f"..slot0-{STAMP}.bin", f"slot0-{STAMP}.bin/.."],
)
async def test_manifest_naming_another_path_is_quarantined(fake: FakeLlama, slot_dir: Path, named: str) -> None:
    # A manifest at start-up (scan) and one written while the sidecar runs (watcher).
    _plant(slot_dir, 0, STAMP, named)
    fake.use(0, 300)
    async with run_sidecar(make_settings(fake.url, slot_dir)) as car:
        assert await car.metric("snapshots_quarantined_total", reason="manifest") == 1
        assert (slot_dir / f"slot0-{STAMP}.json.quarantined").exists()
        assert not (slot_dir / f"slot0-{STAMP}.json").exists()
        await eventually(lambda: car.metric("snapshots_total", slot="0", result="ok"), what="a good snapshot")

        later = "20240102T000000000000Z"
        _plant(slot_dir, 1, later, named.replace("slot0", "slot1"))
        await eventually(
            lambda: _at_least(car, "snapshots_quarantined_total", 2, reason="manifest"),
            what="the planted manifest to be quarantined by the watcher",
        )
        assert (slot_dir / f"slot1-{later}.json.quarantined").exists()
        assert [e["reason"] for e in car.events("snapshot_quarantined")] == ["manifest", "manifest"]

        # A restart makes the sidecar restore what it has indexed: only its own snapshot.
        fake.restart()
        await until(lambda: fake.restores, what="a restore after the restart")
        await eventually(lambda: car.metric("restores_total", slot="1", result="no_snapshot"), what="restore round")
        status = await car.status()
    good = [s["file"] for s in status["snapshots"]["0"]]
    assert [(r.slot, r.filename) for r in fake.restores] == [(0, good[0])]
    assert all("/" not in s.filename and ".." not in s.filename for s in fake.seen if s.filename)
    assert "1" not in status["snapshots"]


@pytest.mark.timeout(20)
async def test_committed_files_are_not_world_readable(fake: FakeLlama, slot_dir: Path) -> None:
    fake.use(0, 300)
    fake.use(1, 200)
    async with run_sidecar(make_settings(fake.url, slot_dir)) as car:
        await eventually(lambda: car.metric("snapshots_total", slot="1", result="ok"), what="snapshot of slot 1")
        await eventually(lambda: car.metric("snapshots_total", slot="0", result="ok"), what="snapshot of slot 0")
    committed = sorted(slot_dir.glob("slot*-*.*"))
    assert len(committed) == 4, committed
    for path in committed:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode & 0o007 == 0, f"{path.name} is {oct(mode)}"


def _plant(slot_dir: Path, slot: int, stamp: str, named: str) -> None:
    """A .bin and a manifest whose ``file`` points somewhere else."""
    data = b"x" * 4096
    (slot_dir / f"slot{slot}-{stamp}.bin").write_bytes(data)
    manifest = {
        "format": 1,
        "slot": slot,
        "file": named,
        "tokens": 50,
        "bytes": len(data),
        "sha256": "0" * 64,
        "created": 1704067200.0,
        "task": 7,
        "fingerprint": {
            "build_info": "b11434-515e85511",
            "model_path": "/models/gemma-3-270m-it-Q4_K_M.gguf",
            "model_size": None,
            "model_params": None,
            "n_ctx": 4096,
            "total_slots": 2,
        },
    }
    (slot_dir / f"slot{slot}-{stamp}.json").write_text(json.dumps(manifest))


async def _status_has_slots(car: Sidecar) -> bool:
    return bool((await car.status())["slots"])


async def _at_least(car: Sidecar, name: str, value: float, **labels: str) -> bool:
    return await car.metric(name, **labels) >= value


async def _read(car: Sidecar, method: str, path: str, headers: dict[str, str]) -> tuple[int, str] | None:
    """The answer once the address's wait for wrong admin tokens is over (None while it gets 429)."""
    code, body = await car.request(method, path, headers=headers)
    return None if code == 429 else (code, body)
