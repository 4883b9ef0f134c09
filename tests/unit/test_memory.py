"""The model's memory kind from its GGUF header, and the boundary a snapshot of such a model ends at."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest

from sidecar.core import events
from sidecar.observe import memory
from sidecar.restore import restorer
from sidecar.save import boundary


def _gguf(path: Path, kv: list[tuple[str, int, bytes]]) -> Path:
    """A GGUF v3 header with ``kv`` (key, value type, packed value) and no tensors."""
    out = b"GGUF" + struct.pack("<IQQ", 3, 0, len(kv))
    for key, vtype, value in kv:
        out += struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", vtype) + value
    path.write_bytes(out)
    return path


def _str(text: str) -> bytes:
    return struct.pack("<Q", len(text)) + text.encode()


def _tokens(n: int) -> bytes:
    """An array of ``n`` strings, like ``tokenizer.ggml.tokens``."""
    return struct.pack("<IQ", 8, n) + b"".join(_str(f"t{i}") for i in range(n))


@pytest.mark.parametrize(
    ("arch", "window", "kind"),
    [
        ("qwen35", 0, events.Memory.HYBRID),
        ("lfm2", 0, events.Memory.HYBRID),
        ("granitehybrid", 0, events.Memory.HYBRID),
        ("nemotron_h", 0, events.Memory.HYBRID),
        ("mamba2", 0, events.Memory.RECURRENT),
        ("gemma3", 512, events.Memory.SWA),
        ("qwen3", 0, events.Memory.ATTENTION),
        ("llama", 0, events.Memory.ATTENTION),
        ("gpt-oss", 128, events.Memory.SWA),
        ("llama4", 0, events.Memory.SWA),  # chunked attention, no key needed
    ],
)
def test_kind_from_the_header(tmp_path: Path, arch: str, window: int, kind: events.Memory) -> None:
    kv = [
        ("general.name", 8, _str("x")),
        ("general.architecture", 8, _str(arch)),
        ("tokenizer.ggml.tokens", 9, _tokens(50)),
        (f"{arch}.block_count", 4, struct.pack("<I", 4)),
    ]
    if window:
        kv.append((f"{arch}.attention.sliding_window", 4, struct.pack("<I", window)))
    assert memory.read(_gguf(tmp_path / "m.gguf", kv)) is kind
    assert memory.cuts_back(kind) is (kind not in (events.Memory.HYBRID, events.Memory.RECURRENT, events.Memory.SWA))


def test_an_unreadable_file_is_unknown_and_handled_as_attention(tmp_path: Path) -> None:
    (tmp_path / "bad.gguf").write_bytes(b"GGML....")
    with pytest.raises(ValueError, match="magic"):
        memory.read(tmp_path / "bad.gguf")
    assert memory.of_file(str(tmp_path / "bad.gguf")) is events.Memory.UNKNOWN
    assert memory.of_file(str(tmp_path / "absent.gguf")) is events.Memory.UNKNOWN
    assert memory.cuts_back(events.Memory.UNKNOWN)


def test_a_header_cut_short_is_an_error(tmp_path: Path) -> None:
    path = _gguf(tmp_path / "m.gguf", [("general.architecture", 8, _str("qwen35"))])
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(ValueError, match="ends early"):
        memory.read(path)


MARKER = [7, 8, 9]


def test_the_prompt_ends_after_the_last_generation_prompt() -> None:
    ids = [1, 2, 7, 8, 9, 3, 4, 5, 7, 8, 9, 40, 41, 42, 43]  # two turns, then the reply 40..43
    assert boundary.prompt_end(ids, MARKER) == 11
    assert boundary.target(11, len(ids)) == 11 - boundary.MARGIN
    assert boundary.prompt_end([1, 2, 3], MARKER) is None
    assert boundary.prompt_end(ids, []) is None
    merged = [1, 2, 70, 8, 9, 40]  # the message's last token took the marker's first
    assert boundary.prompt_end(merged, MARKER) == 5


def test_no_rewind_when_the_slot_holds_nothing_past_the_boundary() -> None:
    assert boundary.target(None, 100) is None
    assert boundary.target(50, 47) is None  # already at the boundary (saved before)
    assert boundary.target(2, 10) is None  # no prompt to speak of
    assert boundary.target(50, 60) == 47


def test_the_marker_is_what_the_template_puts_after_the_user_message() -> None:
    rendered = f"<|im_start|>user\n{boundary.SENTINEL}<|im_end|>\n<|im_start|>assistant\n"
    assert boundary.marker_text(rendered) == "<|im_end|>\n<|im_start|>assistant\n"
    assert boundary.marker_text("no sentinel here") is None
    assert boundary.marker_text(f"x{boundary.SENTINEL}") is None


def test_a_hybrid_is_never_told_to_use_swa_full() -> None:
    for kind in (events.Memory.HYBRID, events.Memory.RECURRENT):
        assert "start llama-server with --swa-full" not in restorer.ineffective_hint(kind)
        assert "cannot be cut back" in restorer.ineffective_hint(kind)
    assert "extends all" not in restorer.ineffective_hint(events.Memory.SWA)
    assert "holds every one of its tokens" in restorer.ineffective_hint(events.Memory.SWA)


@pytest.mark.parametrize(
    ("arch", "window", "found"),
    [
        ("gemma3", 512, memory.Window(512, events.WindowShape.STANDARD)),
        ("gpt-oss", 128, memory.Window(128, events.WindowShape.STANDARD)),
        ("llama4", None, memory.Window(8192, events.WindowShape.CHUNKED)),  # the build's chunk, whatever the key
        ("llama4", 4096, memory.Window(8192, events.WindowShape.CHUNKED)),
        ("llama4", 0, None),  # a key of 0 turns chunked attention off
        ("qwen35", 512, None),
        ("llama", None, None),
    ],
)
def test_the_window_from_the_header(arch: str, window: int | None, found: memory.Window | None) -> None:
    assert memory.window_of(arch, window) == found
    assert (memory.classify(arch, sliding_window=window) is events.Memory.SWA) is (found is not None)


def test_the_window_of_a_model_file_is_read_with_its_kind(tmp_path: Path) -> None:
    kv = [("general.architecture", 8, _str("gemma3")), ("gemma3.attention.sliding_window", 4, struct.pack("<I", 512))]
    path = _gguf(tmp_path / "w.gguf", kv)
    assert memory.window_of_file(str(path)) == memory.Window(512, events.WindowShape.STANDARD)
    assert memory.window_of_file(str(tmp_path / "missing.gguf")) is None


def test_a_model_file_is_read_once_until_it_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _gguf(tmp_path / "m.gguf", [("general.architecture", 8, _str("qwen35"))])
    reads: list[Path] = []
    real = memory.read_model

    def counted(p: Path) -> tuple[events.Memory, memory.Window | None]:
        reads.append(p)
        return real(p)

    monkeypatch.setattr(memory, "read_model", counted)
    assert memory.of_file(str(path)) is events.Memory.HYBRID
    assert memory.of_file(str(path)) is events.Memory.HYBRID
    assert len(reads) == 1  # a restarted server's poll does not walk the header again
    replaced = _gguf(tmp_path / "new.gguf", [("general.architecture", 8, _str("llama"))])
    replaced.replace(path)  # another model file at the same path
    assert memory.of_file(str(path)) is events.Memory.ATTENTION
    assert len(reads) == 2


def test_a_fifo_or_a_device_is_unknown_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)  # an open for reading would wait for a writer, and hold the poll
    assert memory.of_file(str(fifo)) is events.Memory.UNKNOWN
    assert memory.of_file("/dev/zero") is events.Memory.UNKNOWN
