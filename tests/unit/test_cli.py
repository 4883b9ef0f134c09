"""The command line: sidecar.cli.main.main and settings_from. Flags win over env, env over defaults.

`main(["run", ...])` with valid arguments would start the sidecar, so valid
configurations are checked through `settings_from(build_parser().parse_args(...))`
and only refused ones go through `main`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.cli import defaults, options
from sidecar.cli import main as cli
from sidecar.core import config, errors, events, parse
from sidecar.snapshots import manifest, store
from tests.support import clocks


def settings(*args: str) -> config.Settings:
    return cli.settings_from(cli.build_parser().parse_args(["run", *args]))


def test_defaults(tmp_path: Path) -> None:
    s = settings("--slot-dir", str(tmp_path))
    assert s.upstream == config.UpstreamSettings(url="http://127.0.0.1:8080", api_key=None)
    assert s.poll.interval == 1.0
    assert s.snapshots == config.SnapshotSettings(
        slot_dir=tmp_path.resolve(), idle_seconds=2.0, interval=300.0, min_tokens=256
    )
    assert (s.server.host, s.server.port, s.server.admin_token) == ("127.0.0.1", 9464, None)


def test_flags(tmp_path: Path) -> None:
    s = settings(
        "--server",
        "http://llama:8080/",
        "--slot-dir",
        str(tmp_path),
        "--listen",
        "0.0.0.0:9500",
        "--poll-interval",
        "0.5",
        "--idle-seconds",
        "0",
        "--snapshot-interval",
        "60",
        "--min-tokens",
        "0",
        "--api-key",
        "k",
        "--keep-per-slot",
        "3",
        "--max-bytes",
        "1000",
        "--max-age",
        "86400",
        "--request-timeout",
        "1.5",
    )
    assert (s.upstream.url, s.upstream.api_key, s.upstream.request_timeout) == ("http://llama:8080/", "k", 1.5)
    assert s.poll.interval == 0.5
    assert (s.snapshots.idle_seconds, s.snapshots.interval, s.snapshots.min_tokens) == (0.0, 60.0, 0)
    assert (s.snapshots.keep_per_slot, s.snapshots.max_bytes, s.snapshots.max_age) == (3, 1000, 86400.0)
    assert (s.server.host, s.server.port) == ("0.0.0.0", 9500)


@pytest.mark.parametrize(("listen", "host"), [("[::1]:9464", "::1"), (":9464", "0.0.0.0"), ("sidecar:80", "sidecar")])
def test_listen_forms(tmp_path: Path, listen: str, host: str) -> None:
    assert settings("--slot-dir", str(tmp_path), "--listen", listen).server.host == host


@pytest.mark.parametrize(
    "listen",
    ["9464", "localhost", "localhost:http", "127.0.0.1:70000", "127.0.0.1:", "", ":\u0669\u0664\u0666\u0664", ":+80"],
)
def test_bad_listen(tmp_path: Path, capsys: pytest.CaptureFixture[str], listen: str) -> None:
    with pytest.raises(errors.ConfigError, match="HOST:PORT"):
        settings("--slot-dir", str(tmp_path), "--listen", listen)
    assert cli.main(["run", "--slot-dir", str(tmp_path), "--listen", listen]) == 2
    err = capsys.readouterr().err
    assert "--listen" in err
    assert "HOST:PORT" in err
    assert "127.0.0.1:9464" in err


@pytest.mark.parametrize("server", ["localhost:8080", "127.0.0.1", "ftp://llama:8080", "http://", "llama"])
def test_bad_server(tmp_path: Path, capsys: pytest.CaptureFixture[str], server: str) -> None:
    with pytest.raises(errors.ConfigError, match="http"):
        settings("--slot-dir", str(tmp_path), "--server", server)
    assert cli.main(["run", "--slot-dir", str(tmp_path), "--server", server]) == 2
    err = capsys.readouterr().err
    assert "--server" in err
    assert "http://127.0.0.1:8080" in err


@pytest.mark.parametrize("server", ["http://llama:notaport", "http://llama:99999", "http://llama:0", "http://:8080"])
def test_bad_server_port(tmp_path: Path, capsys: pytest.CaptureFixture[str], server: str) -> None:
    with pytest.raises(errors.ConfigError, match="--server"):
        settings("--slot-dir", str(tmp_path), "--server", server)
    assert cli.main(["run", "--slot-dir", str(tmp_path), "--server", server]) == 2
    assert "http://127.0.0.1:8080" in capsys.readouterr().err


def test_missing_slot_dir(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(errors.ConfigError):
        settings()
    assert cli.main(["run"]) == 2
    err = capsys.readouterr().err
    assert "--slot-dir" in err
    assert "LLAMA_SIDECAR_SLOT_DIR" in err
    assert "--slot-save-path" in err


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--poll-interval", "-1", "> 0"),
        ("--poll-interval", "0", "> 0"),
        ("--poll-interval", "fast", "not a float"),
        ("--idle-seconds", "-0.5", ">= 0"),
        ("--snapshot-interval", "-300", "> 0"),
        ("--min-tokens", "-5", ">= 0"),
        ("--min-tokens", "2.5", "'2.5'"),
        ("--keep-per-slot", "0", "> 0"),
        ("--max-bytes", "-1", ">= 0"),
        ("--max-age", "-1", ">= 0"),
        ("--request-timeout", "0", "> 0"),
        ("--final-timeout", "-20", "> 0"),
        ("--min-tokens", "\u0661\u0660", "is not a int"),  # Arabic-Indic digits: int() would take them
        ("--proxy-max-connections", "\u00b2", "is not a int"),  # superscript two
        ("--keep-per-slot", "1_0", "is not a int"),
        ("--proxy-max-body-bytes", " 5", "is not a int"),
        ("--proxy-hold-seconds", "nan", "is not a float"),
        ("--proxy-body-timeout", "inf", "is not a float"),
        ("--poll-interval", "\u0661", "is not a float"),
    ],
)
def test_bad_numbers_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str, says: str
) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["run", "--slot-dir", str(tmp_path), flag, value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert flag in err
    assert says in err


def test_bad_log_format_exits_2(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["run", "--slot-dir", str(tmp_path), "--log-format", "xml"])
    assert info.value.code == 2


def test_no_subcommand_exits_2() -> None:
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == 2


# ---- environment ---------------------------------------------------------------------


def test_env_vars_are_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "LLAMA_SIDECAR_SERVER": "http://llama:8081",
        "LLAMA_SIDECAR_SLOT_DIR": str(tmp_path),
        "LLAMA_SIDECAR_LISTEN": "0.0.0.0:9999",
        "LLAMA_SIDECAR_POLL_INTERVAL": "0.25",
        "LLAMA_SIDECAR_IDLE_SECONDS": "5",
        "LLAMA_SIDECAR_SNAPSHOT_INTERVAL": "120",
        "LLAMA_SIDECAR_MIN_TOKENS": "1024",
        "LLAMA_API_KEY": "from-env",
        "LLAMA_SIDECAR_ADMIN_TOKEN": "admin-token-of-the-env",
        "LLAMA_SIDECAR_MAX_BYTES": "5000",
    }.items():
        monkeypatch.setenv(name, value)
    s = settings()
    assert (s.upstream.url, s.upstream.api_key) == ("http://llama:8081", "from-env")
    assert s.snapshots.slot_dir == tmp_path.resolve()
    assert (s.server.host, s.server.port, s.server.admin_token) == ("0.0.0.0", 9999, "admin-token-of-the-env")
    assert s.poll.interval == 0.25
    assert (s.snapshots.idle_seconds, s.snapshots.interval, s.snapshots.min_tokens) == (5.0, 120.0, 1024)
    assert s.snapshots.max_bytes == 5000


def test_flags_win_over_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    other = tmp_path / "other"
    monkeypatch.setenv("LLAMA_SIDECAR_SERVER", "http://env:1")
    monkeypatch.setenv("LLAMA_SIDECAR_SLOT_DIR", str(other))
    monkeypatch.setenv("LLAMA_SIDECAR_LISTEN", "bad listen value")
    monkeypatch.setenv("LLAMA_SIDECAR_MIN_TOKENS", "-1")  # invalid, but the flag replaces it
    monkeypatch.setenv("LLAMA_API_KEY", "env-key")
    s = settings(
        "--server",
        "http://flag:2",
        "--slot-dir",
        str(tmp_path),
        "--listen",
        "127.0.0.1:1234",
        "--min-tokens",
        "10",
        "--api-key",
        "flag-key",
    )
    assert (s.upstream.url, s.upstream.api_key) == ("http://flag:2", "flag-key")
    assert s.snapshots.slot_dir == tmp_path.resolve()
    assert s.server.port == 1234
    assert s.snapshots.min_tokens == 10


def test_bad_env_number_exits_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LLAMA_SIDECAR_POLL_INTERVAL", "-1")
    assert cli.main(["run", "--slot-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--poll-interval" in err
    assert "LLAMA_SIDECAR_POLL_INTERVAL='-1'" in err
    assert "> 0" in err


def test_bad_env_listen_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLAMA_SIDECAR_LISTEN", "nope")
    assert cli.main(["run", "--slot-dir", str(tmp_path)]) == 2


def test_empty_api_key_means_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLAMA_API_KEY", "")
    assert settings("--slot-dir", str(tmp_path)).upstream.api_key is None


# ---- ls and verify -------------------------------------------------------------------


def _snapshot(slot_dir: Path) -> manifest.Manifest:
    snaps = store.SnapshotStore(slot_dir, clock=clocks.reading(lambda: 1_764_414_733.0))
    temp = snaps.writer.temp_name(0)
    (slot_dir / temp).write_bytes(b"kv" * 1000)
    fp = manifest.Fingerprint.of(events.Identity("b1", "/m.gguf", 1, 4096), n_ctx=4096)
    return snaps.writer.commit(temp, slot=0, tokens=500, written=2000, task=3, fingerprint=fp)


@pytest.mark.parametrize("command", ["ls", "verify"])
def test_ls_and_verify_need_an_existing_slot_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    assert cli.main([command]) == 2
    assert "--slot-dir" in capsys.readouterr().err
    assert cli.main([command, "--slot-dir", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_ls_lists_snapshots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    record = _snapshot(tmp_path)
    assert cli.main(["ls", "--slot-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert record.file in out
    assert "1 snapshot(s)" in out


def test_ls_slot_dir_from_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    record = _snapshot(tmp_path)
    monkeypatch.setenv("LLAMA_SIDECAR_SLOT_DIR", str(tmp_path))
    assert cli.main(["ls", "--json"]) == 0
    assert manifest.Manifest.from_json(capsys.readouterr().out) == record


def test_verify_reports_and_quarantines_a_bad_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    record = _snapshot(tmp_path)
    assert cli.main(["verify", "--slot-dir", str(tmp_path)]) == 0
    assert '{"checked": 1, "bad": 0}' in capsys.readouterr().out
    (tmp_path / record.file).write_bytes(b"xx" * 1000)  # same size, other content
    before = {p.name for p in tmp_path.iterdir()}
    assert cli.main(["verify", "--slot-dir", str(tmp_path), "--dry-run"]) == 1
    out = capsys.readouterr().out
    assert "checksum" in out
    assert '{"checked": 1, "bad": 1}' in out
    assert {p.name for p in tmp_path.iterdir()} == before  # --dry-run renames nothing
    assert cli.main(["verify", "--slot-dir", str(tmp_path)]) == 1
    assert '{"checked": 1, "bad": 1}' in capsys.readouterr().out
    assert (tmp_path / (record.file + ".quarantined")).exists()
    assert cli.main(["verify", "--slot-dir", str(tmp_path)]) == 0  # quarantined files are not checked again


# ---- one table of flags --------------------------------------------------------------


def test_help_shows_every_variable_and_the_defaults_of_config(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for option in options.OPTIONS:
        assert f"[{option.env}]" in text, option.flag
    defaults = config.UpstreamSettings()
    for shown in (
        f"(default {defaults.url}) [LLAMA_SIDECAR_SERVER]",
        f"(default {defaults.request_timeout}) [LLAMA_SIDECAR_REQUEST_TIMEOUT]",
        f"(default {config.PollSettings().interval}) [LLAMA_SIDECAR_POLL_INTERVAL]",
        f"(default {config.ServerSettings().host}:{config.ServerSettings().port}) [LLAMA_SIDECAR_LISTEN]",
        "(default 256) [LLAMA_SIDECAR_MIN_TOKENS]",
        "(default 1073741824) [LLAMA_SIDECAR_MIN_FREE_BYTES]",
    ):
        assert shown in text


def test_unset_flags_take_the_defaults_of_config(tmp_path: Path) -> None:
    s = settings("--slot-dir", str(tmp_path))
    assert s == config.Settings(
        upstream=config.UpstreamSettings(),
        poll=config.PollSettings(),
        snapshots=config.SnapshotSettings(slot_dir=tmp_path.resolve()),
        server=config.ServerSettings(),
        logs=config.LogSettings(),
    )


# ---- API keys and the admin token ----------------------------------------------------


@pytest.mark.parametrize(
    ("given", "sent"),
    [("k1,k2", "k1"), (",k2", "k2"), ('"a,b",c', "a,b"), ("only", "only"), (",", None)],
)
def test_api_key_list_sends_the_first_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: str, sent: str | None
) -> None:
    assert settings("--slot-dir", str(tmp_path), "--api-key", given).upstream.api_key == sent
    monkeypatch.setenv("LLAMA_API_KEY", given)
    assert settings("--slot-dir", str(tmp_path)).upstream.api_key == sent


def test_a_key_list_on_two_lines_exits_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLAMA_API_KEY", "k1\r\nk2")
    assert cli.main(["run", "--slot-dir", str(tmp_path)]) == 2


def test_api_key_file_reads_llama_servers_format(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# rotated 2024-05-01\n\nk-new\nk-old\n")
    assert settings("--slot-dir", str(tmp_path), "--api-key-file", str(keys)).upstream.api_key == "k-new"
    monkeypatch.setenv("LLAMA_API_KEY_FILE", str(keys))
    monkeypatch.setenv("LLAMA_API_KEY", "")  # Compose's `LLAMA_API_KEY: ${LLAMA_API_KEY:-}` when unset
    assert settings("--slot-dir", str(tmp_path)).upstream.api_key == "k-new"


def test_admin_token_file_drops_the_trailing_newline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret-s3cret-s3cret\r\n")
    given = settings("--slot-dir", str(tmp_path), "--admin-token-file", str(token)).server.admin_token
    assert given == "s3cret-s3cret-s3cret"
    token.write_text("s3cret-s3cret-s3cret\n")
    monkeypatch.setenv("LLAMA_SIDECAR_ADMIN_TOKEN_FILE", str(token))
    assert settings("--slot-dir", str(tmp_path)).server.admin_token == "s3cret-s3cret-s3cret"


KEY_FILE = ("--api-key-file", "LLAMA_API_KEY_FILE")
TOKEN_FILE = ("--admin-token-file", "LLAMA_SIDECAR_ADMIN_TOKEN_FILE")


@pytest.mark.parametrize(
    ("option", "content"),
    [
        (KEY_FILE, None),
        (KEY_FILE, ""),
        (KEY_FILE, "# only a comment\n"),
        (TOKEN_FILE, None),
        (TOKEN_FILE, ""),
        (TOKEN_FILE, "\n"),
    ],
)
def test_unreadable_or_empty_secret_file_exits_2(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    option: tuple[str, str],
    content: str | None,
) -> None:
    flag, env = option
    path = tmp_path / "secret"
    if content is not None:
        path.write_text(content)
    assert cli.main(["run", "--slot-dir", str(tmp_path), flag, str(path)]) == 2
    err = capsys.readouterr().err
    assert flag in err
    assert str(path) in err
    monkeypatch.setenv(env, str(path))
    assert cli.main(["run", "--slot-dir", str(tmp_path)]) == 2
    assert flag in capsys.readouterr().err


def test_a_directory_is_not_a_secret_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", "--slot-dir", str(tmp_path), "--api-key-file", str(tmp_path)]) == 2
    assert "cannot read the file" in capsys.readouterr().err


def test_a_secret_given_twice_at_one_level_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = tmp_path / "keys"
    keys.write_text("from-file\n")
    flags = ["run", "--slot-dir", str(tmp_path), "--api-key", "k", "--api-key-file", str(keys)]
    assert cli.main(flags) == 2
    assert "--api-key and --api-key-file are both set" in capsys.readouterr().err
    # A flag wins over a variable, whichever of the two forms each one is.
    monkeypatch.setenv("LLAMA_API_KEY", "from-env")
    assert settings("--slot-dir", str(tmp_path), "--api-key-file", str(keys)).upstream.api_key == "from-file"
    monkeypatch.setenv("LLAMA_API_KEY_FILE", str(tmp_path / "missing"))
    assert settings("--slot-dir", str(tmp_path), "--api-key", "from-flag").upstream.api_key == "from-flag"
    assert cli.main(["run", "--slot-dir", str(tmp_path)]) == 2
    assert "LLAMA_API_KEY and LLAMA_API_KEY_FILE are both set" in capsys.readouterr().err


def test_status_requires_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert settings("--slot-dir", str(tmp_path)).server.status_requires_token is False
    s = settings("--slot-dir", str(tmp_path), "--admin-token", "t" * 16, "--status-requires-token")
    assert s.server.status_requires_token is True
    monkeypatch.setenv("LLAMA_SIDECAR_ADMIN_TOKEN", "t" * 16)
    for word, wanted in (("yes", True), ("1", True), ("off", False), ("False", False)):
        monkeypatch.setenv("LLAMA_SIDECAR_STATUS_REQUIRES_TOKEN", word)
        assert settings("--slot-dir", str(tmp_path)).server.status_requires_token is wanted
    monkeypatch.setenv("LLAMA_SIDECAR_STATUS_REQUIRES_TOKEN", "maybe")
    assert cli.main(["run", "--slot-dir", str(tmp_path)]) == 2
    assert "LLAMA_SIDECAR_STATUS_REQUIRES_TOKEN='maybe'" in capsys.readouterr().err
    monkeypatch.delenv("LLAMA_SIDECAR_STATUS_REQUIRES_TOKEN")
    monkeypatch.delenv("LLAMA_SIDECAR_ADMIN_TOKEN")
    assert cli.main(["run", "--slot-dir", str(tmp_path), "--status-requires-token"]) == 2
    assert "needs an admin token" in capsys.readouterr().err


def test_proxy_is_off_by_default_and_on_with_its_flags(tmp_path: Path) -> None:
    assert settings("--slot-dir", str(tmp_path)).proxy == config.ProxySettings()
    assert config.ProxySettings().host is None
    s = settings(
        "--slot-dir",
        str(tmp_path),
        "--proxy-listen",
        "0.0.0.0:8081",
        "--proxy-hold-seconds",
        "30",
        "--proxy-max-body-bytes",
        "1000",
    )
    assert (s.proxy.host, s.proxy.port, s.proxy.hold_seconds, s.proxy.max_body_bytes) == ("0.0.0.0", 8081, 30.0, 1000)


def test_proxy_settings_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLAMA_SIDECAR_PROXY_LISTEN", "127.0.0.1:8090")
    monkeypatch.setenv("LLAMA_SIDECAR_PROXY_HOLD_SECONDS", "7.5")
    monkeypatch.setenv("LLAMA_SIDECAR_PROXY_MAX_BODY_BYTES", "2048")
    s = settings("--slot-dir", str(tmp_path))
    assert (s.proxy.host, s.proxy.port, s.proxy.hold_seconds, s.proxy.max_body_bytes) == ("127.0.0.1", 8090, 7.5, 2048)


def test_bad_proxy_listen_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", "--slot-dir", str(tmp_path), "--proxy-listen", "8081"]) == 2
    assert "--proxy-listen '8081' is not HOST:PORT" in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "value"), [("--proxy-hold-seconds", "0"), ("--proxy-max-body-bytes", "-1")])
def test_bad_proxy_numbers_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["run", "--slot-dir", str(tmp_path), flag, value])
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err


def test_shared_store_with_router_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "shared").mkdir()
    store = f"file://{tmp_path / 'shared'}"
    assert settings("--slot-dir", str(tmp_path), "--shared-store", store).shared.location is not None
    assert settings("--slot-dir", str(tmp_path), "--router").upstream.router is True
    assert cli.main(["run", "--slot-dir", str(tmp_path), "--router", "--shared-store", store]) == 2
    assert "--shared-store is not offered with --router" in capsys.readouterr().err


def test_router_mode_follows_the_server_unless_forced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert settings("--slot-dir", str(tmp_path)).upstream.router is None
    assert settings("--slot-dir", str(tmp_path), "--router").upstream.router is True
    assert settings("--slot-dir", str(tmp_path), "--no-router").upstream.router is False
    monkeypatch.setenv("LLAMA_SIDECAR_ROUTER", "0")
    assert settings("--slot-dir", str(tmp_path)).upstream.router is False
    assert settings("--slot-dir", str(tmp_path), "--router").upstream.router is True


@pytest.mark.parametrize("text", ["0", "7", "1024", "000123"])
def test_integers_in_ascii_digits_are_read(text: str) -> None:
    assert parse.integer(text) == int(text)
    assert parse.integer(text.encode()) == int(text)


@pytest.mark.parametrize(
    "text", ["", "\u00b2", "\u0660", "\uff10", "1_0", "+1", "-1", " 1", "1 ", "0x1", "1e3", "9" * 19]
)
def test_integers_in_anything_else_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="ASCII digits"):
        parse.integer(text)


def test_a_signed_integer_takes_one_minus() -> None:
    assert parse.integer("-12", signed=True) == -12
    with pytest.raises(ValueError, match="ASCII digits"):
        parse.integer("--1", signed=True)


@pytest.mark.parametrize(
    ("token", "said"),
    [
        ("short-token", "has 11 characters, fewer than the 16 required"),
        (" padded-admin-token-0123", "starts or ends with whitespace"),
        ("padded-admin-token-0123\t", "starts or ends with whitespace"),
    ],
)
def test_a_short_or_padded_admin_token_stops_the_start_saying_why_and_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], token: str, said: str
) -> None:
    assert cli.main(["run", "--slot-dir", str(tmp_path), "--admin-token", token]) == 2
    err = capsys.readouterr().err
    assert said in err
    assert "--admin-token" in err
    assert token.strip() not in err  # the message never repeats the secret
    path = tmp_path / "token"
    path.write_text(token + "\n")
    monkeypatch.setenv("LLAMA_SIDECAR_ADMIN_TOKEN_FILE", str(path))
    assert cli.main(["run", "--slot-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert said in err
    assert str(path) in err
    path.write_text("admin-token-0123456789\n\n")  # a second newline: whitespace the file's rule does not drop
    assert cli.main(["run", "--slot-dir", str(tmp_path)]) == 2
    assert "starts or ends with whitespace" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "command", "size"),
    [
        ((), ("--cache-ram", "1024"), 1024 << 20),
        ((), ("-cram", "0"), 0),
        ((), (), config.ProxySettings().server_cache_ram_bytes),
        (("--server-cache-ram-bytes", "4096"), ("--cache-ram", "1024"), 4096),
    ],
)
def test_the_launcher_tells_the_library_the_ram_cache_its_command_gives_the_server(
    tmp_path: Path, flags: tuple[str, ...], command: tuple[str, ...], size: int
) -> None:
    """A size the user gave the sidecar wins; else the child's --cache-ram; else llama-server's default."""
    state = tmp_path / "state"
    own = ["--slot-dir", str(tmp_path), "--state-dir", str(state), "--proxy-listen", "127.0.0.1:0", *flags]
    args, cmd = cli._split(["run", *own, "--", "llama-server", "-m", "m", *command])
    assert cmd is not None
    ns = cli.build_parser().parse_args(args)
    with defaults.prepared(ns, cli.settings_from(ns, launching=True), cmd, {}) as done:
        assert done.settings.proxy.server_cache_ram_bytes == size
