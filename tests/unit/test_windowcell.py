"""The cell a sliding-window slot file gets below its window, so that llama-server reuses it after a restore."""

from __future__ import annotations

import struct
from pathlib import Path

import prometheus_client
import pytest
import structlog

from sidecar.core import config, events, metrics, outcomes, protocols
from sidecar.observe import memory
from sidecar.save import policy, snapshotter, windowsave
from sidecar.snapshots import windowcell

ROW = 8
"""Bytes of one K or V row per cell (a tiny model)."""


def _cache(positions: list[int], layers: int, *, v_trans: bool = False, streams: int = 1) -> bytes:
    """One ``llama_kv_cache::state_write`` of ``positions`` (one sequence), rows filled with each cell's position."""
    out = struct.pack("<I", streams)
    for s in range(streams):
        if s:
            out += struct.pack("<I", 0)
            continue
        out += struct.pack("<I", len(positions))
        if not positions:
            continue
        for p in positions:
            out += struct.pack("<iIi", p, 1, 0)
        out += struct.pack("<IIII", int(v_trans), layers, 0, 0)
        for layer in range(layers):
            out += struct.pack("<iQ", 1, ROW)
            out += b"".join(bytes([(p + layer) % 251 + 1]) * ROW for p in positions)
        for layer in range(layers):
            if v_trans:
                out += struct.pack("<iII", 1, 2, ROW // 2)
                for _ in range(ROW // 2):
                    out += b"".join(bytes([(p + layer) % 251 + 1]) * 2 for p in positions)
            else:
                out += struct.pack("<iQ", 1, ROW)
                out += b"".join(bytes([(p + layer) % 251 + 1]) * ROW for p in positions)
    return out


def _slot_file(
    held: int, window: int, *, v_trans: bool = False, swa: list[int] | None = None, streams: int = 1
) -> bytes:
    tokens = struct.pack("<iII", -1, 1, held) + struct.pack(f"<{held}I", *range(held))
    head = struct.pack("<III", windowcell.MAGIC, windowcell.VERSION, len(tokens) // 4) + tokens
    kept = swa if swa is not None else list(range(max(0, held - window), held))
    return (
        head
        + _cache(list(range(held)), 1, v_trans=v_trans, streams=streams)
        + _cache(kept, 5, v_trans=v_trans, streams=streams)
    )


def _windowed(buf: bytes) -> tuple[list[int], bytes]:
    """The windowed cache's cell positions and its bytes, as a reader of the file finds them."""
    starts = windowcell.sections(buf)
    assert starts is not None
    assert len(starts) == 3
    at = starts[1]
    (count,) = struct.unpack_from("<I", buf, at + 4)
    positions = [struct.unpack_from("<i", buf, at + 8 + 12 * i)[0] for i in range(count)]
    return positions, buf[at:]


@pytest.mark.parametrize(("v_trans", "streams"), [(False, 1), (True, 1), (False, 2)])
def test_a_cell_below_the_window_masked_for_every_next_token(v_trans: bool, streams: int) -> None:
    """``streams`` 2: ``-np 2`` without a unified KV buffer, slot 0 (the other stream's count, 0, after it)."""
    buf = _slot_file(700, 512, v_trans=v_trans, streams=streams)
    padding = windowcell.plan(buf, window=512)
    assert padding.outcome is windowcell.Outcome.PADDED
    assert padding.position == 699 - 512  # the next token (700) is 513 positions past it: masked
    padded = buf[: padding.offset] + padding.tail
    positions, tail = _windowed(padded)
    assert positions == [187, *range(188, 700)]
    assert windowcell.sections(padded) is not None  # still a slot file of two caches
    # each layer's rows: a zero row for the added cell, then the server's rows unchanged
    _, before = _windowed(buf)
    assert len(tail) - len(before) == 12 + 10 * ROW
    assert padded.endswith(struct.pack("<I", 0)) is (streams == 2)
    assert tail.count(bytes(ROW)) >= 10 or v_trans
    assert windowcell.plan(padded, window=512).outcome is windowcell.Outcome.ALREADY  # once is enough


def test_the_global_layers_and_tokens_are_left_as_they_are() -> None:
    buf = _slot_file(600, 512)
    padding = windowcell.plan(buf, window=512)
    starts = windowcell.sections(buf)
    assert starts is not None
    assert padding.offset > starts[1]  # only the windowed cache changes
    assert (buf[: padding.offset] + padding.tail)[: starts[1]] == buf[: starts[1]]


def test_a_conversation_that_fits_in_the_window_gets_no_cell() -> None:
    padding = windowcell.plan(_slot_file(300, 512), window=512)
    assert padding.outcome is windowcell.Outcome.SHORT


@pytest.mark.parametrize("window", [256, 1024])
def test_a_header_that_lies_about_the_window_leaves_the_file_alone(window: int) -> None:
    """The server keeps 512: a stated 256 would put the cell inside what the next token sees."""
    padding = windowcell.plan(_slot_file(2000, 512), window=window)
    assert padding.outcome is windowcell.Outcome.WINDOW_MISMATCH
    assert padding.tail == b""
    assert "1488..1999" in padding.detail


def test_a_window_smaller_than_the_cells_is_a_mismatch() -> None:
    padding = windowcell.plan(_slot_file(2000, 512, swa=list(range(1600, 2000))), window=512)
    assert padding.outcome is windowcell.Outcome.WINDOW_MISMATCH
    assert "1600..1999" in padding.detail


def test_chunked_attention_keeps_the_current_chunk() -> None:
    buf = _slot_file(9000, 8192, swa=list(range(8192, 9000)))
    padding = windowcell.plan(buf, window=8192, shape=events.WindowShape.CHUNKED)
    assert padding.outcome is windowcell.Outcome.PADDED
    assert padding.position == 8999 - 8192


@pytest.mark.parametrize(
    "buf",
    [
        b"",
        b"GGUF" + bytes(40),
        struct.pack("<III", windowcell.MAGIC, 3, 0),
        _slot_file(700, 512)[:-3],  # cut short
        struct.pack("<III", windowcell.MAGIC, windowcell.VERSION, 0) + _cache(list(range(700)), 2),  # one cache
    ],
)
def test_what_is_not_an_iswa_slot_file_is_left_alone(buf: bytes) -> None:
    assert windowcell.plan(buf, window=512).outcome is windowcell.Outcome.LAYOUT


def _result(size: int) -> protocols.ActionResult:
    return protocols.ActionResult(slot=0, filename="f", tokens=700, bytes=size, server_ms=1.0)


def _model(tmp_path: Path, window: int) -> str:
    def s(text: str) -> bytes:
        return struct.pack("<Q", len(text)) + text.encode()

    kv = [("general.architecture", s("gemma3")), ("gemma3.attention.sliding_window", struct.pack("<I", window))]
    body = b"GGUF" + struct.pack("<IQQ", 3, 0, len(kv))
    for key, value in kv:
        body += s(key) + struct.pack("<I", 8 if key.startswith("general") else 4) + value
    path = tmp_path / f"m{window}.gguf"
    path.write_bytes(body)
    return str(path)


def test_a_staged_file_is_padded_in_place_and_its_size_told(tmp_path: Path) -> None:
    staged = tmp_path / "slot.bin"
    staged.write_bytes(_slot_file(700, 512))
    size = staged.stat().st_size
    result = windowsave.apply(staged, _result(size), model_path=_model(tmp_path, 512), kind=events.Memory.SWA)
    assert result.bytes == staged.stat().st_size == size + 12 + 10 * ROW
    assert _windowed(staged.read_bytes())[0][0] == 187


def test_a_lying_header_is_said_once_and_the_file_kept(tmp_path: Path) -> None:
    staged = tmp_path / "slot.bin"
    data = _slot_file(2000, 512, swa=list(range(1600, 2000)))
    staged.write_bytes(data)
    model = _model(tmp_path, 512)
    with structlog.testing.capture_logs() as logs:
        for _ in range(2):
            result = windowsave.apply(staged, _result(len(data)), model_path=model, kind=events.Memory.SWA)
    assert result.bytes == len(data)
    assert staged.read_bytes() == data
    said = [e for e in logs if e["event"] == "window_cell_not_added"]
    assert len(said) == 1
    assert said[0]["reason"] == "window_mismatch"
    assert "effect" in said[0]
    assert "hint" in said[0]


def test_other_models_files_are_not_touched(tmp_path: Path) -> None:
    staged = tmp_path / "slot.bin"
    data = _slot_file(700, 512)
    staged.write_bytes(data)
    for kind in (events.Memory.ATTENTION, events.Memory.HYBRID, events.Memory.UNKNOWN, None):
        windowsave.apply(staged, _result(len(data)), model_path=_model(tmp_path, 512), kind=kind)
    assert staged.read_bytes() == data
    assert memory.window_of_file(str(tmp_path / "none.gguf")) is None


def test_a_slot_that_fits_in_the_window_is_not_saved(tmp_path: Path) -> None:
    """No restore of it could be reused (no position below the window): settled, never swapped in."""
    identity = events.Identity("b1", _model(tmp_path, 512), 1, 4096, memory=events.Memory.SWA)
    saver = snapshotter.Snapshotter(
        slot_actions=None,  # type: ignore[arg-type]
        snapshots=None,  # type: ignore[arg-type]
        stats=metrics.Metrics(prometheus_client.CollectorRegistry(), version="t"),
        settings=config.SnapshotSettings(slot_dir=tmp_path),
        clock=protocols.SystemClock(),
    )

    def save(tokens: int) -> policy.Save:
        return policy.Save(0, events.SlotContent(1, tokens), tokens, policy.SaveReason.IDLE)

    record = saver.records.within_window(save(512), identity)
    assert record is not None
    assert record.cause is outcomes.SaveCause.WITHIN_WINDOW
    assert record.result is outcomes.SaveResult.SKIPPED
    assert saver.records.within_window(save(513), identity) is None
    full = events.Identity("b1", identity.model_path, 1, 4096, memory=events.Memory.SWA_FULL)
    assert saver.records.within_window(save(100), full) is None
