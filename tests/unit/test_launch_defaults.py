"""The defaults of ``run -- llama-server ARGS``: state dir, RAM staging, block store, the proxy's address; bad input.

Every refusal happens before anything starts (exit status 2, the flag and the fix named); a read-only
or full disk is a real one (a small tmpfs mounted for the test, as root: CI runs as root).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import socket
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from sidecar.app import run as app_run
from sidecar.cli import defaults, options
from sidecar.cli import main as cli
from sidecar.core import config, errors, mounts, parse
from sidecar.launch import places, slotsize
from tests.support import llamabed
from tests.support import mounts as test_mounts

MIB = 1 << 20


def parsed(*args: str) -> tuple[argparse.Namespace, list[str]]:
    own, command = cli._split(["run", *args])
    assert command is not None
    return cli.build_parser().parse_args(own), command


def prepare(*args: str, env: dict[str, str] | None = None) -> contextlib.AbstractContextManager[defaults.Prepared]:
    ns, command = parsed(*args)
    return defaults.prepared(ns, cli.settings_from(ns, launching=True), command, env or {})


@pytest.fixture
def shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory standing for /dev/shm (the host's own is left alone)."""
    root = tmp_path / "shm"
    root.mkdir()
    monkeypatch.setattr(places, "SHM", root)
    return root


def test_the_state_dir_defaults_to_xdg_state_home_else_the_home_dirs_local_state() -> None:
    assert places.default_state_dir({"XDG_STATE_HOME": "/x/state", "HOME": "/h"}) == Path("/x/state/llama-kv-sidecar")
    assert places.default_state_dir({"HOME": "/h"}) == Path("/h/.local/state/llama-kv-sidecar")
    assert places.default_state_dir({"XDG_STATE_HOME": "relative", "HOME": "/h"}) == Path(
        "/h/.local/state/llama-kv-sidecar"
    )


def test_ram_staging_when_the_tmpfs_holds_the_largest_slot_else_disk_with_the_cost_and_the_fix() -> None:
    assert places.choose(slot_bytes=100 * MIB, tmpfs_free=200 * MIB).staging is places.Staging.RAM
    assert places.choose(slot_bytes=None, tmpfs_free=200 * MIB).staging is places.Staging.RAM
    short = places.choose(slot_bytes=100 * MIB, tmpfs_free=64 * MIB)
    assert short.staging is places.Staging.DISK
    assert "64 MiB free" in short.why
    assert "100 MiB" in short.why
    assert "--shm-size" in short.why
    assert places.choose(slot_bytes=1, tmpfs_free=None).staging is places.Staging.DISK


def test_the_largest_slot_is_kv_per_token_times_the_context_read_from_the_models_header() -> None:
    shape = slotsize.of_model(llamabed.model_path())
    assert shape.layers == 18
    assert shape.kv_heads == (1,)
    assert shape.key_length == 256
    per_token = 18 * 1 * (256 + 256) * 2
    assert slotsize.slot_bytes(shape, ctx_size=1000) == 1000 * (per_token + 4)
    assert slotsize.slot_bytes(shape, ctx_size=0) == shape.context_length * (per_token + 4)
    assert slotsize.slot_bytes(shape, ctx_size=1000, cache_type_k="q8_0", cache_type_v="q8_0") < 1000 * per_token


def test_the_one_command_creates_the_state_dir_0700_stages_in_ram_and_keeps_the_store_there(
    tmp_path: Path, shm: Path
) -> None:
    state = tmp_path / "state"
    model = str(llamabed.model_path())
    with prepare("--", "llama-server", "-m", model, "--port", "0", env={"XDG_STATE_HOME": str(tmp_path / "x")}):
        pass  # the state dir of the environment
    with prepare("--state-dir", str(state), "--", "llama-server", "-m", model, "-c", "4096", "--port", "0") as done:
        snap = done.settings.snapshots
        assert stat.S_IMODE(state.stat().st_mode) == 0o700
        assert snap.store_dir == state / places.STORE
        assert done.settings.launch.state_dir == state  # the model's checksums are remembered there, not in RAM
        # a first save is staged on disk if it would not fit the RAM staging dir: 18 layers x 1 KV head x
        # (256 + 256) x 2 bytes, and 4 bytes of token id, per token
        assert snap.staging_bytes_per_token == 18 * 512 * 2 + 4
        assert snap.staging == "ram"
        assert snap.slot_dir.parent == shm
        assert stat.S_IMODE(snap.slot_dir.stat().st_mode) == 0o700
        assert done.launch is not None
        at = done.launch.argv.index("--slot-save-path")
        assert done.launch.argv[at + 1] == str(snap.slot_dir)
        assert done.settings.proxy.host == "127.0.0.1"
        assert done.settings.proxy.port == 0
        ram = snap.slot_dir
    assert not ram.exists(), "the RAM staging dir is removed at exit"
    assert (tmp_path / "x" / "llama-kv-sidecar").is_dir()


def test_a_tmpfs_without_room_for_the_largest_slot_stages_on_disk_beside_the_store(tmp_path: Path, shm: Path) -> None:
    with test_mounts.tmpfs(shm, "1m"):
        state = tmp_path / "state"
        with prepare(
            "--state-dir", str(state), "--", "llama-server", "-m", str(llamabed.model_path()), "--port", "0"
        ) as done:
            snap = done.settings.snapshots
            assert snap.staging == "disk"
            assert snap.slot_dir == state / places.SLOTS
            assert "MiB free, less than the largest slot file" in snap.staging_note
            assert not any(shm.iterdir()), "nothing was made in the tmpfs"


def test_whole_files_stay_on_disk_in_the_state_dir(tmp_path: Path, shm: Path) -> None:
    state = tmp_path / "state"
    with prepare("--state-dir", str(state), "--whole-files", "--", "llama-server", "-m", "m", "--port", "0") as done:
        assert done.settings.snapshots.store_dir is None
        assert done.settings.snapshots.slot_dir == state / places.SLOTS


def test_whole_files_of_an_earlier_run_are_converted_when_staging_moves_to_ram(tmp_path: Path, shm: Path) -> None:
    state = tmp_path / "state"
    (state / places.SLOTS).mkdir(parents=True)
    with prepare("--state-dir", str(state), "--", "llama-server", "-m", "m", "--port", "0") as done:
        assert done.settings.snapshots.convert_dir == state / places.SLOTS


def test_beside_a_server_a_tmpfs_slot_dir_gets_the_block_store_in_the_state_dir_a_disk_one_whole_files(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    with test_mounts.tmpfs(tmp_path / "ram", "8m") as ram:
        ns = cli.build_parser().parse_args(["run", "--slot-dir", str(ram), "--state-dir", str(state)])
        with defaults.prepared(ns, cli.settings_from(ns), None, {}) as done:
            assert done.settings.snapshots.store_dir == state / places.STORE
    disk = tmp_path / "disk"
    disk.mkdir()
    test_mounts.assert_on_disk(disk)
    ns = cli.build_parser().parse_args(["run", "--slot-dir", str(disk), "--state-dir", str(state)])
    with defaults.prepared(ns, cli.settings_from(ns), None, {}) as done:
        assert done.settings.snapshots.store_dir is None


def test_mounts_tell_a_tmpfs_from_a_disk() -> None:
    info = "1 0 8:1 / / rw - ext4 /dev/sda1 rw\n2 1 0:5 / /dev/shm rw - tmpfs tmpfs rw,size=64m\n"
    assert mounts.fstype(info, Path("/dev/shm/x")) == "tmpfs"
    assert mounts.fstype(info, Path("/var/lib")) == "ext4"
    assert mounts.on_tmpfs(Path("/proc")) is False


# ---- bad input: exit status 2 before anything starts, naming the flag and the fix ----------------------------


def run_status(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = cli.main(["run", *args])
    return code, capsys.readouterr().err


def test_a_state_dir_whose_parent_is_missing_is_refused_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = run_status(capsys, "--state-dir", str(tmp_path / "no" / "state"), "--", "llama-server", "--port", "0")
    assert code == 2
    assert "--state-dir" in err
    assert "does not exist" in err
    assert not (tmp_path / "no").exists()


def test_a_state_dir_on_a_read_only_disk_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with test_mounts.tmpfs(tmp_path / "ro", "1m") as ro:
        test_mounts.remount(ro, "ro")
        code, err = run_status(capsys, "--state-dir", str(ro / "state"), "--", "llama-server", "--port", "0")
        assert code == 2
        assert "read-only" in err
        assert "--state-dir" in err
        code, err = run_status(capsys, "--state-dir", str(ro), "--", "llama-server", "--port", "0")
        assert code == 2
        assert "cannot be written" in err
        assert "read-only" in err


def test_a_state_dir_on_a_full_disk_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with test_mounts.tmpfs(tmp_path / "full", "1m") as full:
        filler = full / "filler"
        with filler.open("wb") as fh:
            try:
                while True:
                    fh.write(bytes(64 << 10))
                    fh.flush()
            except OSError:
                pass
        code, err = run_status(capsys, "--state-dir", str(full), "--", "llama-server", "--port", "0")
        assert code == 2
        assert "disk is full" in err
        assert "--state-dir" in err


def test_two_sidecars_on_one_state_dir_the_second_is_refused_naming_the_first(tmp_path: Path, shm: Path) -> None:
    state = tmp_path / "state"
    with prepare("--state-dir", str(state), "--", "llama-server", "-m", "m", "--port", "0"):
        second = prepare("--state-dir", str(state), "--", "llama-server", "-m", "m", "--port", "0")
        with pytest.raises(errors.ConfigError, match=r"another llama-kv-sidecar holds the state dir .*pid") as caught:
            second.__enter__()
        assert "--state-dir of its own" in str(caught.value)
    with prepare("--state-dir", str(state), "--", "llama-server", "-m", "m", "--port", "0"):
        pass  # released at exit


def test_a_port_already_taken_is_refused_before_anything_starts(
    tmp_path: Path, shm: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        state = tmp_path / "state"
        code, err = run_status(capsys, "--state-dir", str(state), "--", "llama-server", "-m", "m", "--port", str(port))
        assert code == 2
        assert f"127.0.0.1:{port} is already in use" in err
        assert "--port" in err
        assert not any(shm.iterdir()), "nothing was staged"


def test_llama_servers_own_slot_save_path_is_refused_with_the_fix(
    tmp_path: Path, shm: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state"
    args = ("--state-dir", str(state), "--", "llama-server", "-m", "m", "--port", "0", "--slot-save-path", "/srv/x")
    code, err = run_status(capsys, *args)
    assert code == 2
    assert "--slot-save-path /srv/x" in err
    assert "--slot-dir /srv/x" in err
    assert not any(shm.iterdir()), "the RAM staging dir made meanwhile is removed"


def test_llama_servers_own_api_key_is_taken_by_the_sidecar(tmp_path: Path, shm: Path) -> None:
    state = tmp_path / "state"
    with prepare(
        "--state-dir", str(state), "--", "llama-server", "-m", "m", "--port", "0", "--api-key", "k1,k2"
    ) as done:
        assert done.settings.upstream.api_key == "k1"
        assert done.settings.upstream.keys is not None
        assert done.settings.upstream.keys.keys == ("k1", "k2")
    keys = tmp_path / "keys"
    keys.write_text("kf\n")
    args = ("--state-dir", str(state), "--", "llama-server", "--port", "0", "--api-key-file", str(keys))
    with prepare(*args) as done:
        assert done.settings.upstream.api_key == "kf"


def test_a_unix_socket_host_is_refused_naming_the_flag(tmp_path: Path, shm: Path) -> None:
    refused = prepare("--state-dir", str(tmp_path / "s"), "--", "llama-server", "--host", "/run/x.sock")
    with pytest.raises(errors.ConfigError, match=r"--host /run/x.sock is a unix socket.*--no-proxy"):
        refused.__enter__()


def test_no_proxy_keeps_the_servers_own_address(tmp_path: Path, shm: Path) -> None:
    with prepare("--state-dir", str(tmp_path / "s"), "--no-proxy", "--", "llama-server", "--port", "8123") as done:
        assert done.settings.proxy.host is None
        assert done.settings.upstream.url == "http://127.0.0.1:8123"
    assert config.LaunchSettings().proxy
    assert options.NO_PROXY.env == "LLAMA_SIDECAR_NO_PROXY"


def test_a_list_of_addresses_is_one_proxy_listen_value() -> None:
    assert parse.proxy_listen("127.0.0.1,[::1]:8080") == ("127.0.0.1,::1", 8080)
    assert parse.proxy_listen("127.0.0.1,::1:8080") == ("127.0.0.1,::1", 8080)
    assert parse.proxy_listen("[::1]:8080") == ("::1", 8080)
    with pytest.raises(errors.ConfigError, match="--proxy-listen"):
        parse.proxy_listen("127.0.0.1,:8080")


async def test_a_proxy_that_cannot_listen_exits_2_and_leaves_no_task_never_awaited(
    tmp_path: Path, recwarn: pytest.WarningsRecorder
) -> None:
    """The tasks made before the proxy starts are closed when it cannot (no ``coroutine ... never awaited``)."""
    settings = config.Settings(
        upstream=config.UpstreamSettings(url="http://127.0.0.1:1", request_timeout=0.5),
        poll=config.PollSettings(),
        snapshots=config.SnapshotSettings(slot_dir=tmp_path),
        server=config.ServerSettings(port=0),
        proxy=config.ProxySettings(host="192.0.2.1", port=0),  # not an address of this host: the bind fails
    )
    with pytest.raises(errors.ConfigError, match=r"--proxy-listen 192\.0\.2\.1:0: cannot listen there"):
        await app_run.main(settings)
    gc.collect()
    assert not [w for w in recwarn.list if "never awaited" in str(w.message)]


def test_ls_reads_the_default_state_dirs_store_and_says_when_there_is_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert cli.main(["ls"]) == 2
    assert "no snapshots in the state dir" in capsys.readouterr().err
    (tmp_path / "llama-kv-sidecar" / places.STORE).mkdir(parents=True)
    assert cli.main(["ls"]) == 0
    assert f"block store {tmp_path / 'llama-kv-sidecar' / places.STORE}" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flag", "read"),
    [
        ("--no-proxy", lambda s: s.launch.proxy),
        ("--no-proxy-prefix-header", lambda s: s.proxy.prefix_header),
    ],
)
def test_a_switch_spelt_no_x_turns_its_setting_off_as_its_variable_does(
    flag: str, read: Callable[[config.Settings], bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """argparse reads a BooleanOptionalAction flag spelt --no-X as its own negative form: here it means 'on'."""
    ns = cli.build_parser().parse_args(["run", "--slot-dir", "/tmp", flag])
    assert read(cli.settings_from(ns)) is False
    option = next(o for o in options.OPTIONS if o.flag == flag)
    monkeypatch.setenv(option.env, "1")
    assert read(cli.settings_from(cli.build_parser().parse_args(["run", "--slot-dir", "/tmp"]))) is False
    monkeypatch.delenv(option.env)
    assert read(cli.settings_from(cli.build_parser().parse_args(["run", "--slot-dir", "/tmp"]))) is True


def test_a_state_dir_whose_block_store_vanished_is_refused_not_made_anew(
    tmp_path: Path, shm: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state"
    with prepare("--state-dir", str(state), "--", "llama-server", "-m", "m", "--port", "0"):
        pass
    assert (state / places.STORE).is_dir()
    (state / places.STORE).rename(tmp_path / "elsewhere")  # removed, or a volume not mounted
    code, err = run_status(capsys, "--state-dir", str(state), "--", "llama-server", "-m", "m", "--port", "0")
    assert code == 2
    assert "held a block store" in err
    assert "is gone" in err
    assert "--state-dir" in err
    assert not (state / places.STORE).exists(), "not made anew"
