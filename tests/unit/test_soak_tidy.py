"""What a soak leaves on disk: only its logs after a run that met every goal, everything after a MISSED one."""

from __future__ import annotations

from pathlib import Path

from bench.soak import runner


def a_run(work: Path) -> None:
    (work / "slots").mkdir(parents=True)
    (work / "slots" / "slot0.bin").write_bytes(b"\0" * 1024)
    (work / "s3" / "data").mkdir(parents=True)
    (work / "s3" / "data" / "object").write_bytes(b"x")
    (work / "disk").mkdir()
    (work / "sidecar.log").write_text("{}\n")
    (work / "llama-server-1.log").write_text("started\n")
    (work / "stray.tmp").write_text("")


def test_a_run_that_met_every_goal_keeps_only_its_logs(tmp_path: Path) -> None:
    a_run(tmp_path)
    said = runner.tidy(tmp_path, met=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama-server-1.log", "sidecar.log"]
    assert str(tmp_path) in said
    assert "removed" in said


def test_a_missed_run_keeps_every_file_for_a_look(tmp_path: Path) -> None:
    a_run(tmp_path)
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    said = runner.tidy(tmp_path, met=False)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before
    assert str(tmp_path) in said
    assert "kept" in said
