"""--shared-store on the command line, and `llama-kv-sidecar gc` on a shared directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sidecar.cli import main as cli
from sidecar.core import config, location


def settings(*args: str) -> config.Settings:
    return cli.settings_from(cli.build_parser().parse_args(["run", *args]))


def test_shared_store_is_off_by_default(tmp_path: Path) -> None:
    assert settings("--slot-dir", str(tmp_path)).shared.location is None


def test_shared_store_from_flag_or_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "key")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9000")
    where = settings("--slot-dir", str(tmp_path), "--shared-store", "s3://kv-shared/prod").shared.location
    assert where is not None
    assert (where.bucket, where.prefix, where.endpoint) == (
        "kv-shared",
        "prod",
        "http://127.0.0.1:9000",
    )
    monkeypatch.setenv("LLAMA_SIDECAR_SHARED_STORE", f"file://{tmp_path}")
    where = settings("--slot-dir", str(tmp_path)).shared.location
    assert where is not None
    assert where.scheme is location.Scheme.FILE


def test_missing_credentials_stop_the_start_with_what_to_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    assert cli.main(["run", "--slot-dir", str(tmp_path), "--shared-store", "s3://kv-shared/prod"]) == 2
    err = capsys.readouterr().err
    assert "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in err
    assert "AWS_ENDPOINT_URL_S3" in err


def test_bad_url_stops_the_start(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", "--slot-dir", str(tmp_path), "--shared-store", "ftp://host/x"]) == 2
    assert "s3://BUCKET/PREFIX" in capsys.readouterr().err


def _put(root: Path, key: str, *, age: float, size: int = 10) -> Path:
    path = root / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)
    stamp = time.time() - age
    os.utime(path, (stamp, stamp))
    return path


def test_gc_command_unpublishes_old_snapshots_then_deletes_after_the_grace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old_manifest = _put(tmp_path, "ns-1/manifests/xxh3-128-aa.json", age=7200)
    old_blob = _put(tmp_path, "ns-1/blobs/xxh3-128-aa.bin", age=7200)
    new = [
        _put(tmp_path, "ns-1/manifests/xxh3-128-bb.json", age=10),
        _put(tmp_path, "ns-1/blobs/xxh3-128-bb.bin", age=10),
    ]
    url = f"file://{tmp_path}"

    assert cli.main(["gc", "--shared-store", url, "--max-age", "3600", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would unpublish ns-1/manifests/xxh3-128-aa.json" in out
    assert old_manifest.exists()

    assert cli.main(["gc", "--shared-store", url, "--max-age", "3600", "--grace", "0"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary == {"unpublished": 1, "deleted": 0, "kept_bytes": 10}
    assert not old_manifest.exists()
    assert old_blob.exists()
    assert len(list((tmp_path / "ns-1" / "gone").iterdir())) == 1

    time.sleep(1.1)  # tombstones are dated to the second; the grace is 0
    assert cli.main(["gc", "--shared-store", url, "--max-age", "3600", "--grace", "0"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["deleted"] == 2
    assert not old_blob.exists()
    assert all(p.exists() for p in new)


def test_gc_command_needs_a_store(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["gc"]) == 2
    assert "--shared-store" in capsys.readouterr().err


def test_s3_without_its_extra_stops_the_start_naming_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`pip install .` has no S3 client: --shared-store s3:// exits 2 and says which extra to install."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "key")
    for module in ("aiobotocore", "aiobotocore.session"):
        monkeypatch.setitem(sys.modules, module, None)  # what an install without the extra sees: ImportError
    assert cli.main(["run", "--slot-dir", str(tmp_path), "--shared-store", "s3://kv-shared/prod"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'llama-kv-sidecar[s3]'" in err
    assert "s3://kv-shared/prod" in err
    assert cli.main(["gc", "--shared-store", "s3://kv-shared/prod", "--max-age", "60"]) == 2
    assert "pip install 'llama-kv-sidecar[s3]'" in capsys.readouterr().err
    # A shared directory needs no S3 client.
    assert settings("--slot-dir", str(tmp_path), "--shared-store", f"file://{tmp_path}").shared.location is not None


def test_the_sidecar_imports_no_s3_client_unless_the_store_is_s3() -> None:
    code = (
        "import sys; import sidecar.cli.main, sidecar.app.run, sidecar.shared.service; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('aiobotocore', 'botocore')))"
    )
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert found.strip() == "[]"
