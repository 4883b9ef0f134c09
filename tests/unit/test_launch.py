"""Launcher mode's pure parts: the llama-server command line, the restart decision, the output lines, the ends."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.core import errors, outcomes
from sidecar.launch import argv, child, output, supervisor

SLOTS = Path("/srv/slots")


def plan(*args: str, proxy: bool = True, key: bool = False, server: str | None = None) -> argv.Launch:
    return argv.plan(
        ["llama-server", *args],
        slot_dir=SLOTS,
        proxy=proxy,
        port=41234,
        sidecar_has_key=key,
        server_given=server,
        resolve=Path,
    )


def test_the_launcher_adds_what_the_sidecar_needs_behind_the_proxy() -> None:
    launch = plan("-m", "model.gguf", "-np", "2")
    assert launch.argv == (
        "llama-server",
        "-m",
        "model.gguf",
        "-np",
        "2",
        "--slot-save-path",
        str(SLOTS),
        "--metrics",
        "--host",
        "127.0.0.1",
        "--port",
        "41234",
    )
    assert launch.url == "http://127.0.0.1:41234"
    assert not launch.router


def test_the_users_own_equal_arguments_are_kept_not_repeated() -> None:
    launch = plan("-m", "m.gguf", f"--slot-save-path={SLOTS}", "--metrics")
    assert launch.argv.count("--metrics") == 1
    assert "--slot-save-path" not in launch.added
    assert launch.added == ("--host", "127.0.0.1", "--port", "41234")


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (("--slot-save-path", "/elsewhere"), "--slot-save-path"),
        (("--no-slots",), "--no-slots"),
        (("--host", "/run/llama.sock"), "--host"),
        (("--port", "http"), "--port"),
        (("--api-key", "k"), "--api-key"),
        (("--api-key-file", "f"), "--api-key-file"),
    ],
)
def test_conflicting_arguments_are_refused_naming_the_flag(args: tuple[str, ...], named: str) -> None:
    with pytest.raises(errors.ConfigError, match=named):
        plan("-m", "m.gguf", *args)


@pytest.mark.parametrize(
    ("args", "env", "listen", "taken"),
    [
        ((), {}, (("127.0.0.1",), 8080), ()),
        (("--port", "8081"), {}, (("127.0.0.1",), 8081), ("--port",)),
        (("--host=0.0.0.0", "--port=9000"), {}, (("0.0.0.0",), 9000), ("--host", "--port")),
        (("--host", "127.0.0.1,[::1]"), {}, (("127.0.0.1", "::1"), 8080), ("--host",)),
        (
            (),
            {"LLAMA_ARG_HOST": "0.0.0.0", "LLAMA_ARG_PORT": "8090"},
            (("0.0.0.0",), 8090),
            ("LLAMA_ARG_HOST", "LLAMA_ARG_PORT"),
        ),
        (("--port", "8081"), {"LLAMA_ARG_PORT": "8090"}, (("127.0.0.1",), 8081), ("--port",)),
        (
            ("--port", "8081"),
            {"AIP_MODE": "PREDICTION", "AIP_HTTP_PORT": "7070"},
            (("127.0.0.1",), 7070),
            ("AIP_HTTP_PORT",),
        ),
        ((), {"AIP_MODE": "PREDICTION"}, (("127.0.0.1",), 8080), ("AIP_HTTP_PORT",)),
    ],
)
def test_the_proxy_takes_llama_servers_own_address_and_the_server_moves_to_the_private_port(
    args: tuple[str, ...], env: dict[str, str], listen: tuple[tuple[str, ...], int], taken: tuple[str, ...]
) -> None:
    launch = argv.plan(
        ["llama-server", "-m", "m.gguf", *args],
        slot_dir=SLOTS,
        proxy=True,
        port=41234,
        sidecar_has_key=False,
        env=env,
        resolve=Path,
    )
    assert launch.listen == listen
    assert launch.taken == taken
    assert launch.argv[-4:] == ("--host", "127.0.0.1", "--port", "41234")
    assert not any(a.startswith(("--host", "--port")) for a in launch.argv[:-4])  # the user's own are dropped
    assert launch.url == "http://127.0.0.1:41234"
    # Vertex AI mode: llama-server binds AIP_HTTP_PORT whatever --port says, so the child is given the private one
    assert dict(launch.env) == ({"AIP_HTTP_PORT": "41234"} if env.get("AIP_MODE") == "PREDICTION" else {})


def test_the_command_tells_the_model_context_and_cache_types_flags_over_variables() -> None:
    sized = argv.sizing(["llama-server", "-m", "a.gguf", "-c", "8192", "-ctk", "q8_0"], {"LLAMA_ARG_CTX_SIZE": "4"})
    assert sized == argv.Sizing(model="a.gguf", ctx_size=8192, cache_type_k="q8_0", cache_type_v="f16")
    assert argv.sizing(["llama-server"], {"LLAMA_ARG_MODEL": "b.gguf"}) == argv.Sizing(model="b.gguf", ctx_size=0)
    assert argv.key_argument(["llama-server", "--api-key", "k1,k2"]) == ("--api-key", "k1,k2")
    assert argv.key_argument(["llama-server", "-m", "x"]) is None


def test_the_sidecars_own_server_is_refused_in_launcher_mode() -> None:
    with pytest.raises(errors.ConfigError, match="--server is set"):
        plan("-m", "m.gguf", server="--server")


def test_a_key_is_allowed_when_the_sidecar_has_one() -> None:
    assert "--api-key" in plan("--api-key", "k", key=True).argv


def test_nothing_after_the_separator_is_refused() -> None:
    with pytest.raises(errors.ConfigError, match="nothing after '--'"):
        argv.plan([], slot_dir=SLOTS, proxy=True, port=1, sidecar_has_key=False)


@pytest.mark.parametrize(
    ("args", "url"),
    [
        ((), "http://127.0.0.1:8080"),
        (("--port", "9000"), "http://127.0.0.1:9000"),
        (("--host", "0.0.0.0", "--port=9001"), "http://127.0.0.1:9001"),
        (("--host", "::"), "http://[::1]:8080"),
        (("--host", "10.1.2.3", "--port", "7"), "http://10.1.2.3:7"),
    ],
)
def test_without_the_proxy_the_users_address_is_kept_and_followed(args: tuple[str, ...], url: str) -> None:
    launch = plan(*args, proxy=False)
    assert launch.url == url
    assert "--port" not in launch.added
    assert "--host" not in launch.added


@pytest.mark.parametrize("args", [("--host", "/run/llama.sock"), ("--port", "0"), ("--port", "http")])
def test_without_the_proxy_an_address_the_sidecar_cannot_reach_is_refused(args: tuple[str, ...]) -> None:
    with pytest.raises(errors.ConfigError, match=args[0]):
        plan(*args, proxy=False)


def test_router_arguments_are_recognised() -> None:
    assert plan("--models-dir", "/models").router
    assert plan("--models-preset=p.ini").router


@pytest.mark.parametrize(
    ("args", "size"),
    [
        ((), None),
        (("--cache-ram", "2048"), 2048 << 20),
        (("-cram", "0"), 0),
        (("--cache-ram=512", "-cram", "1024"), 1024 << 20),
        (("--cache-ram", "-1"), argv.CACHE_RAM_UNLIMITED),
    ],
)
def test_the_ram_cache_the_command_gives_the_server_is_read(args: tuple[str, ...], size: int | None) -> None:
    assert plan("-m", "x.gguf", *args).cache_ram_bytes == size


def test_a_ram_cache_size_that_is_no_number_is_refused_naming_the_flag() -> None:
    with pytest.raises(errors.ConfigError, match="--cache-ram"):
        plan("--cache-ram", "lots")


def test_keys_are_blanked_in_the_logged_command() -> None:
    shown = supervisor.shown(("llama-server", "--api-key", "sekret", "--api-key-file=/k", "-m", "x"))
    assert shown == ["llama-server", "--api-key", "***", "--api-key-file=***", "-m", "x"]


def test_output_lines_are_split_bounded_and_the_cut_counted() -> None:
    lines = output.Lines(max_line=10)
    assert lines.feed(b"one\ntw") == [("one", 0)]
    assert lines.feed(b"o\r\n" + b"x" * 25 + b"\nlast") == [("two", 0), ("x" * 10, 15)]
    assert lines.end() == [("last", 0)]
    assert lines.end() == []


@given(st.lists(st.binary(max_size=50), max_size=20))
def test_output_lines_never_pass_the_bound(chunks: list[bytes]) -> None:
    lines = output.Lines(max_line=16)
    got = [line for chunk in chunks for line in lines.feed(chunk)] + lines.end()
    assert all(len(text.encode("utf-8", "surrogateescape")) <= 16 * 3 for text, _ in got)
    whole = b"".join(chunks)
    assert len(got) == whole.count(b"\n") + (1 if whole and not whole.endswith(b"\n") else 0)


@pytest.mark.parametrize(
    ("returncode", "asked", "cause", "words"),
    [
        (0, False, outcomes.ServerExit.EXITED, "exit status 0"),
        (1, False, outcomes.ServerExit.FAILED, "exit status 1"),
        (-signal.SIGKILL, False, outcomes.ServerExit.KILLED, "killed by SIGKILL"),
        (-signal.SIGSEGV, False, outcomes.ServerExit.KILLED, "killed by SIGSEGV"),
        (-signal.SIGTERM, True, outcomes.ServerExit.STOPPED, "killed by SIGTERM"),
        (0, True, outcomes.ServerExit.STOPPED, "exit status 0"),
    ],
)
def test_an_end_is_read_from_the_exit_status(
    returncode: int, asked: bool, cause: outcomes.ServerExit, words: str
) -> None:
    end = child.ended(returncode, asked=asked)
    assert end.cause is cause
    assert end.describe() == words
