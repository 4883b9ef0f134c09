"""The differential run of llama.cpp's server tests: the wrapper's arguments and the comparison (pure)."""

from __future__ import annotations

from bench import llamatests, llamawrap


def test_models_map_to_the_local_one_and_the_address_stays_in_the_command_for_the_launcher_to_take() -> None:
    args = ["--port", "8123", "--temp", "0.8", "--host", "127.0.0.1", "--hf-repo", "ggml-org/x", "--hf-file", "y.gguf"]
    args += ["--no-slots", "--model-draft", "d.gguf", "-c", "256"]
    direct = llamawrap.command("direct", args, model="/m.gguf", server="/bin/ls", sidecar="/bin/sc", work="/tmp")
    mapped = ["--temp", "0.8", "--no-slots", "-c", "256", "--model", "/m.gguf", "--model-draft", "/m.gguf"]
    assert direct == ["/bin/ls", *mapped, "--port", "8123", "--host", "127.0.0.1"]
    through = llamawrap.command("sidecar", args, model="/m.gguf", server="/bin/ls", sidecar="/bin/sc", work="/tmp")
    assert through[:2] == ["/bin/sc", "run"]
    assert "--proxy-listen" not in through, "the launcher's proxy takes the server's own address, as a user's would"
    rest = through[through.index("--") + 1 :]
    assert rest == [
        "/bin/ls", "--temp", "0.8", "-c", "256", "--model", "/m.gguf", "--model-draft", "/m.gguf",
        "--port", "8123", "--host", "127.0.0.1",
    ]  # fmt: skip
    router = llamawrap.command("direct", ["--port", "1"], model="/m.gguf", server="s", sidecar="c", work="/tmp")
    assert "--model" not in router, "a router names no model: none is added"


def test_only_differences_outside_the_allow_list_fail() -> None:
    direct = {"a::x": "passed", "a::y": "failed", "a::z": "passed", "a::w": "passed"}
    through = {"a::x": "passed", "a::y": "passed", "a::z": "failed"}
    bad, fine = llamatests.compare(direct, through, {"a::z": "why"})
    assert bad == [
        "a::w: direct passed, through the sidecar missing",
        "a::y: direct failed, through the sidecar passed",
    ]
    assert fine == ["a::z: direct passed, through the sidecar failed (allowed: why)"]
