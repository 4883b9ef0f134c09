"""`llama-kv-sidecar ls` and `verify` on a real slot dir, as a user runs them."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

from sidecar.core import protocols
from sidecar.snapshots import manifest, slotfile, store

FP = manifest.Fingerprint("b1", "/models/m.gguf", 100, 200, 4096, 1)


def _snapshot(directory: Path, slot: int, size: int, model: str | None = None) -> manifest.Manifest:
    snaps = store.SnapshotStore(directory, clock=protocols.SystemClock()).for_model(model)
    temp = snaps.writer.temp_name(slot)
    (directory / temp).write_bytes(os.urandom(size))
    return snaps.writer.commit(temp, slot=slot, tokens=size // 10, written=size, task=3, fingerprint=FP)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sidecar", *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_ls_lists_every_snapshot_with_its_manifest(tmp_path: Path) -> None:
    a = _snapshot(tmp_path, 0, 5000)
    b = _snapshot(tmp_path, 1, 7000)
    out = _run("ls", "--slot-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert a.file in out.stdout
    assert b.file in out.stdout
    assert "2 snapshot(s)" in out.stdout
    lines = _run("ls", "--slot-dir", str(tmp_path), "--json").stdout.splitlines()
    digests = sorted(json.loads(line)["checksum"]["digest"] for line in lines)
    assert digests == sorted([a.checksum.digest, b.checksum.digest])


def test_ls_lists_every_models_snapshots_and_one_models_with_model(tmp_path: Path) -> None:
    plain = _snapshot(tmp_path, 0, 5000)
    alpha = _snapshot(tmp_path, 0, 5000, model="alpha")
    beta = _snapshot(tmp_path, 1, 5000, model="beta")
    every = _run("ls", "--slot-dir", str(tmp_path))
    assert every.returncode == 0, every.stderr
    assert "3 snapshot(s)" in every.stdout
    assert f"{alpha.file}  (model alpha)" in every.stdout
    assert plain.file in every.stdout
    one = _run("ls", "--slot-dir", str(tmp_path), "--model", "beta", "--json").stdout.splitlines()
    assert [json.loads(line)["file"] for line in one] == [beta.file]
    assert [json.loads(line)["model"] for line in one] == ["beta"]
    assert _run("verify", "--slot-dir", str(tmp_path)).returncode == 0
    assert json.loads(_run("verify", "--slot-dir", str(tmp_path)).stdout.splitlines()[-1])["checked"] == 3


def test_verify_reports_and_quarantines_a_flipped_byte_and_dry_run_touches_nothing(tmp_path: Path) -> None:
    good = _snapshot(tmp_path, 0, 5000)
    bad = _snapshot(tmp_path, 1, 5000)
    assert _run("verify", "--slot-dir", str(tmp_path)).returncode == 0
    with (tmp_path / bad.file).open("r+b") as fh:
        fh.seek(100)
        byte = fh.read(1)
        fh.seek(100)
        fh.write(bytes([byte[0] ^ 1]))
    dry = _run("verify", "--slot-dir", str(tmp_path), "--dry-run")
    assert dry.returncode == 1
    assert f"BAD {bad.file}: checksum" in dry.stdout
    assert (tmp_path / bad.file).exists()
    real = _run("verify", "--slot-dir", str(tmp_path))
    assert real.returncode == 1
    assert json.loads(real.stdout.splitlines()[-1]) == {"checked": 2, "bad": 1}
    assert (tmp_path / (bad.file + ".quarantined")).exists()
    assert (tmp_path / good.file).exists()
    assert _run("verify", "--slot-dir", str(tmp_path)).returncode == 0


def test_ls_on_a_missing_dir_says_so(tmp_path: Path) -> None:
    out = _run("ls", "--slot-dir", str(tmp_path / "nope"))
    assert out.returncode == 2
    assert "does not exist" in out.stderr


def test_ls_names_conversations_by_hash_and_shows_no_token_ids(tmp_path: Path) -> None:
    ids = [90_000 + i for i in range(3 * slotfile.BLOCK_TOKENS)]
    words = struct.pack("<iII", -1, slotfile.PACKED_VERSION, len(ids)) + slotfile.pack_ids(ids) + b"\0" * 4
    data = struct.pack("<III", slotfile.MAGIC, slotfile.VERSION, len(words) // 4) + words + b"\x07" * 64
    snaps = store.SnapshotStore(tmp_path, clock=protocols.SystemClock())
    temp = snaps.writer.temp_name(0)
    (tmp_path / temp).write_bytes(data)
    indexed = snaps.writer.commit(temp, slot=0, tokens=len(ids), written=len(data), task=3, fingerprint=FP)
    plain = _snapshot(tmp_path, 0, 5000)
    out = _run("ls", "--slot-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert indexed.index is not None
    rows = {line.split()[-1]: line.split()[0] for line in out.stdout.splitlines()[1:-1]}
    assert rows == {indexed.file: indexed.index.chain[-1][:12], plain.file: "-"}
    assert "1 in the conversation library" in out.stdout
    assert str(ids[5]) not in out.stdout


def test_ls_refuses_a_manifest_of_numbers_that_are_not_and_lists_the_others(tmp_path: Path) -> None:
    good = _snapshot(tmp_path, 0, 5000)
    for value in (str(2**63), "NaN", "Infinity", "1e400"):
        bad = _snapshot(tmp_path, 1, 3000)
        path = tmp_path / bad.file.replace(".bin", ".json")
        path.write_text(path.read_text().replace(f'"created": {bad.created!r}', f'"created": {value}'))
        assert f'"created": {value}' in path.read_text()
    out = _run("ls", "--slot-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    assert good.file in out.stdout
    assert "1 snapshot(s)" in out.stdout
