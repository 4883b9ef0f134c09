"""The ``defaults`` bench section's verdict: the one command's paired price per turn, MISSED above 1.03x."""

from __future__ import annotations

from bench import defaults, library_paths
from sidecar.launch import argv as launch_argv


def point(alone: float, ours: float, n: int = 6) -> library_paths.Point:
    rounds = [[alone] * n, [alone] * n]
    direct = library_paths.Run(n, library_paths.DIRECT, rounds)
    proxied = library_paths.Run(n, library_paths.PROXY, [[ours] * n, [ours] * n], way=defaults.WAY)
    return library_paths.Point(n, direct, proxied, ram=True)


def test_the_one_command_within_3_percent_of_llama_server_alone_is_met_above_it_missed() -> None:
    (met,) = defaults.verdicts([point(0.100, 0.102)])
    assert met.startswith("MET")
    assert "1.020x" in met
    (missed,) = defaults.verdicts([point(0.100, 0.104, n=20)])
    assert missed.startswith("MISSED")
    assert "N=20" in missed
    assert "1.040x" in missed


def test_the_llama_server_command_keeps_its_port_for_the_proxy_and_loses_its_slot_save_path() -> None:
    argv = ["llama-server", "-m", "m.gguf", "--host", "127.0.0.1", "--port", "9", "--slot-save-path", "/d/"]
    kept = launch_argv.without(argv, (launch_argv.SLOT_SAVE_PATH, launch_argv.PORT))
    assert kept == ["llama-server", "-m", "m.gguf", "--host", "127.0.0.1"]
