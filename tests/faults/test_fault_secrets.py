"""Secrets: read from files (not the process list), the Bearer scheme in any case, /status behind the token."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import aiohttp
import pytest

from tests.support.fakellama import FakeLlama, MakeFake
from tests.support.faultbed import Sidecar, make_settings, run_sidecar
from tests.support.net import free_port
from tests.support.proxybed import raw_exchange, status_of
from tests.support.sidecarbed import SidecarProcess
from tests.support.wait import eventually, until

ADMIN = "admin-8Jd2kQ0v-c3Xm"
API_KEY = "sk-llama-file-31c7e0"


@pytest.mark.timeout(40)
async def test_secrets_from_files_stay_out_of_the_process_list(
    make_fake: MakeFake, slot_dir: Path, tmp_path: Path
) -> None:
    fake = make_fake(api_key=API_KEY)
    fake.use(0, 300)
    key_file = tmp_path / "api-key"
    key_file.write_text(f"# llama-server's --api-key-file format\n{API_KEY}\nsk-older-key\n")
    token_file = tmp_path / "admin-token"
    token_file.write_text(ADMIN + "\n")
    proc = SidecarProcess(
        fake.url,
        slot_dir,
        tmp_path / "sidecar.log",
        extra={
            "--api-key-file": str(key_file), "--admin-token-file": str(token_file), "--poll-interval": "0.05",
            "--idle-seconds": "0", "--min-tokens": "10", "--request-timeout": "0.5",
        },
    )  # fmt: skip
    try:
        url = proc.start().url
        assert proc.proc is not None
        await until(lambda: list(slot_dir.glob("slot0-*.json")), timeout=10, what="a snapshot made with the file's key")
        cmdline = Path(f"/proc/{proc.proc.pid}/cmdline").read_bytes().decode()
        environ = Path(f"/proc/{proc.proc.pid}/environ").read_bytes().decode()
        admin = {"Authorization": f"Bearer {ADMIN}"}
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session,
            session.post(url + "/restore", headers=admin) as resp,
        ):
            assert resp.status == 200, await resp.text()
    finally:
        proc.terminate(15)
    for text in (cmdline, environ, "\n".join(proc.lines())):
        assert API_KEY not in text
        assert ADMIN not in text
    assert {s.auth for s in fake.requests("/slots")} == {f"Bearer {API_KEY}"}


@pytest.mark.timeout(20)
@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
async def test_the_bearer_scheme_is_matched_in_any_case(fake: FakeLlama, slot_dir: Path, scheme: str) -> None:
    async with run_sidecar(make_settings(fake.url, slot_dir, admin_token=ADMIN)) as car:
        code, body = await car.request("POST", "/restore", headers={"Authorization": f"{scheme} {ADMIN}"})
        assert code == 200, body
        for wrong in (f"Basic {ADMIN}", f"{scheme}{ADMIN}", f"{scheme} {ADMIN.upper()}"):
            code, body = await car.request("POST", "/restore", headers={"Authorization": wrong})
            assert code == 401, (wrong, body)


@pytest.mark.timeout(20)
async def test_status_can_require_the_admin_token(fake: FakeLlama, slot_dir: Path) -> None:
    fake.use(0, 300)
    settings = make_settings(fake.url, slot_dir, admin_token=ADMIN)
    settings = dataclasses.replace(settings, server=dataclasses.replace(settings.server, status_requires_token=True))
    async with run_sidecar(settings) as car:
        await eventually(lambda: car.metric("snapshots_total", slot="0", result="ok"), what="a snapshot")
        for path in ("/status", "/"):  # the status page has the same access as /status
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {ADMIN}"}):
                code, body = await car.request("GET", path, headers=headers)
                assert code == 401, (path, headers, body)
                assert "slot0-" not in body
            if path == "/status":  # the right token, which also clears the wrong tries before the next path's
                code, body = await car.request("GET", "/status", headers={"Authorization": f"bearer {ADMIN}"})
                assert code == 200, body
                assert json.loads(body)["snapshots"]["0"]
        code, body = await car.request("GET", "/", headers={"Authorization": f"Bearer {ADMIN}"})
        assert code == 200, body
        assert "<h2>Slots</h2>" in body
        for path in ("/healthz", "/readyz", "/metrics"):  # probes and scrapes need no token
            code, body = await car.get(path)
            assert code == 200, (path, body)


@pytest.mark.timeout(20)
async def test_status_is_open_by_default(fake: FakeLlama, slot_dir: Path) -> None:
    async with run_sidecar(make_settings(fake.url, slot_dir, admin_token=ADMIN)) as car:
        code, body = await car.get("/status")
        assert code == 200, body
        code, body = await car.get("/")
        assert code == 200, body


@pytest.mark.timeout(60)
async def test_header_bytes_that_are_not_utf8_get_a_400_or_401_and_no_secret_reaches_a_log_line_metric_or_page(
    make_fake: MakeFake, slot_dir: Path, tmp_path: Path
) -> None:
    fake = make_fake(api_key=API_KEY)
    (tmp_path / "admin-token").write_text(ADMIN + "\n")
    (tmp_path / "api-key").write_text(API_KEY + "\n")
    proxy_port = free_port()
    proc = SidecarProcess(
        fake.url,
        slot_dir,
        tmp_path / "sidecar.log",
        extra={
            "--admin-token-file": str(tmp_path / "admin-token"), "--api-key-file": str(tmp_path / "api-key"),
            "--proxy-listen": f"127.0.0.1:{proxy_port}", "--request-timeout": "0.5",
        },
    )  # fmt: skip
    spoilt = (
        b"Authorization: Bearer " + ADMIN.encode() + b"\xff",  # a byte that is not UTF-8 after the token
        b"Authorization: Bearer \xc3" + ADMIN.encode(),
        b"X-Api-Key: " + API_KEY.encode() + b"\xfe",
        b"Authorization: Bearer \x01" + ADMIN.encode(),  # a control byte: aiohttp's parser refuses the request
        b"X-Api-Key: \x01" + API_KEY.encode(),
    )
    targets = {
        proc: (b"POST /snapshot?slot=0", b"POST /restore", b"GET /status"),
        "proxy": (b"POST /slots/0?action=erase", b"POST /v1/chat/completions", b"GET /props"),
    }
    try:
        proc.start()
        answers: list[tuple[bytes, bytes, int]] = []
        for where, requests in targets.items():
            port = proc.port if where is proc else proxy_port
            for line in requests:
                for header in spoilt:
                    data = line + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n"
                    answer = await raw_exchange(port, data + header + b"\r\n\r\n{}")
                    answers.append((line, header[:20], status_of(answer)))
        for line, header, code in answers:
            if line.startswith(b"GET"):  # a read needs no token: answered, or refused for the bad byte
                assert code in (200, 400, 401), (line, header, code)
            else:
                assert code in (400, 401), (line, header, code)
        assert not [a for a in answers if a[2] == 500]
        assert fake.requests("erase") == []  # the slot action did not reach llama-server
        admin = {"Authorization": f"Bearer {ADMIN}"}
        shown = [proc.request("GET", path, headers=admin)[1] for path in ("/status", "/", "/metrics")]
        assert all(shown), "the status page, /status and /metrics answered"
    finally:
        proc.terminate(15)
    text = "\n".join([*proc.lines(), *shown])
    assert "Error handling request" in text  # aiohttp logged the requests its parser refused, with tracebacks
    assert ADMIN not in text
    assert API_KEY not in text
    assert '"locals"' not in text


@pytest.mark.timeout(30)
async def test_repeated_wrong_admin_tokens_from_one_address_are_slowed_down_and_the_right_one_clears_it(
    fake: FakeLlama, slot_dir: Path
) -> None:
    wrong = {"Authorization": f"Bearer {ADMIN[:-1]}"}
    right = {"Authorization": f"Bearer {ADMIN}"}
    async with run_sidecar(make_settings(fake.url, slot_dir, admin_token=ADMIN)) as car:
        codes = [(await car.request("POST", "/restore", headers=wrong))[0] for _ in range(6)]
        assert codes == [401] * 6  # 5 free tries, and the sixth wrong one starts a wait
        async with car.session.post(car.url + "/restore", headers=right) as resp:
            assert resp.status == 429, await resp.text()  # even the right token waits: a guess would too
            assert int(resp.headers["Retry-After"]) >= 1
            assert "too many wrong admin tokens" in (await resp.json())["error"]
        assert len(car.events("admin_token_tries_slowed")) == 1
        started = time.monotonic()
        await eventually(lambda: _code(car, "POST", "/restore", right, 200), timeout=5, what="the right token")
        assert time.monotonic() - started > 0.5
        assert await _code(car, "POST", "/restore", wrong, 401)  # cleared: free tries again


async def _code(car: Sidecar, method: str, path: str, headers: dict[str, str], wanted: int) -> bool:
    return (await car.request(method, path, headers=headers))[0] == wanted
