"""Pure decisions of the shared store: URL and credentials, keys, best match, fetch or prefill, gc plan."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from sidecar.core import errors, events, hashing, location
from sidecar.shared import catalog, decide, gc, keys, objstore, records
from sidecar.snapshots import manifest

FP = manifest.Fingerprint(
    build_info="b1-abc",
    model_path="/models/gemma-3-270m.Q4_K_M.gguf",
    model_size=253_000_000,
    model_params=268_000_000,
    n_ctx=8192,
    total_slots=2,
    weights="xxh3-128:" + "1" * 32,
    adapters=(),
)
CREDS = {"AWS_ACCESS_KEY_ID": "AKIA", "AWS_SECRET_ACCESS_KEY": "secret"}


# ---- location ---------------------------------------------------------------------------


def test_s3_url_takes_endpoint_keys_and_region_from_the_aws_environment() -> None:
    env = CREDS | {
        "AWS_ENDPOINT_URL_S3": "http://127.0.0.1:9000",
        "AWS_ENDPOINT_URL": "http://other",
        "AWS_REGION": "eu-1",
    }
    where = location.parse("s3://kv-cache/team/a/", env)
    assert (where.scheme, where.bucket, where.prefix, where.endpoint, where.region) == (
        location.Scheme.S3,
        "kv-cache",
        "team/a",
        "http://127.0.0.1:9000",
        "eu-1",
    )
    assert "secret" not in repr(where)
    assert "AKIA" not in repr(where)


def test_s3_url_without_endpoint_means_aws_and_the_default_region() -> None:
    where = location.parse("s3://kv-cache", CREDS)
    assert (where.endpoint, where.region, where.prefix) == (None, location.DEFAULT_REGION, "")


@pytest.mark.parametrize(
    ("url", "env", "names"),
    [
        ("s3://kv-cache/p", {}, ["AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"]),
        ("s3://kv-cache/p", {"AWS_ACCESS_KEY_ID": "a"}, ["AWS_SECRET_ACCESS_KEY"]),
        ("s3://Bad_Bucket/p", CREDS, ["not a bucket name"]),
        ("http://host/p", CREDS, ["s3://BUCKET/PREFIX", "file:///PATH"]),
        ("s3://kv-cache/p", CREDS | {"AWS_ENDPOINT_URL_S3": "minio:9000"}, ["AWS_ENDPOINT_URL_S3", "http"]),
        ("file://relative/path", {}, ["absolute path"]),
        ("file:///does/not/exist", {}, ["not a directory"]),
    ],
)
def test_unusable_store_settings_name_what_to_set(url: str, env: dict[str, str], names: list[str]) -> None:
    with pytest.raises(errors.ConfigError) as caught:
        location.parse(url, env)
    for name in names:
        assert name in str(caught.value)


def test_file_url_names_a_directory(tmp_path: Path) -> None:
    where = location.parse(f"file://{tmp_path}", {})
    assert (where.scheme, where.prefix) == (location.Scheme.FILE, str(tmp_path))


# ---- keys -----------------------------------------------------------------------------


def test_namespace_changes_with_everything_a_restore_must_match() -> None:
    base = keys.namespace(FP)
    assert base.startswith("gemma-3-270m.q4_k_m-")
    assert keys.namespace(dataclasses.replace(FP, n_ctx=4096)) == base  # context size does not change the KV layout
    for change in (
        {"weights": "xxh3-128:" + "2" * 32},
        {"build_info": "b2-def"},
        {"total_slots": 4},
        {"model_path": "/other/gemma-3-270m.Q4_K_M.gguf"},
        {"adapters": (events.Adapter(0, "/lora/a.gguf", 1.0),)},
    ):
        assert keys.namespace(dataclasses.replace(FP, **change)) != base, change


def test_keys_are_content_addressed_and_manifests_sort_apart_from_blobs() -> None:
    checksum = manifest.Checksum(hashing.Algorithm.XXH3_128, "a" * 32)
    ns = keys.namespace(FP)
    assert keys.blob("team", ns, checksum) == f"team/{ns}/blobs/xxh3-128-{'a' * 32}.bin"
    assert keys.shared_manifest("", ns, checksum) == f"{ns}/manifests/xxh3-128-{'a' * 32}.json"
    assert keys.is_manifest(keys.shared_manifest("team", ns, checksum))
    assert not keys.is_manifest(keys.blob("team", ns, checksum))


# ---- best match -----------------------------------------------------------------------


def _record(
    chain: tuple[str, ...], *, tokens: int = 1000, uploaded: float = 0.0, digest: str = "a"
) -> records.SharedRecord:
    snap = manifest.Manifest(
        slot=0,
        file="slot0-20261130T120000000000Z.bin",
        tokens=tokens,
        bytes=5_000_000,
        checksum=manifest.Checksum(hashing.Algorithm.XXH3_128, digest * 32),
        generation=1,
        created=1.0,
        task=None,
        fingerprint=FP,
    )
    return records.SharedRecord(snap, "blob", chain, 128, uploaded)


def test_best_match_is_the_longest_shared_prefix_then_the_newest() -> None:
    short = _record(("h1", "h2"), uploaded=5)
    longer = _record(("h1", "h2", "h3", "x"), uploaded=1)
    longer_newer = _record(("h1", "h2", "h3", "y"), uploaded=2)
    other = _record(("z1", "z2", "z3", "z4"), uploaded=9)
    found = catalog.best_match(
        [short, longer, longer_newer, other], ("h1", "h2", "h3", "h4"), max_tokens=8192, block_tokens=128
    )
    assert found is not None
    assert (found.record, found.blocks, found.tokens) == (longer_newer, 3, 384)


def test_best_match_skips_what_does_not_fit_the_slot_or_shares_nothing() -> None:
    big = _record(("h1", "h2"), tokens=9000)
    assert catalog.best_match([big], ("h1",), max_tokens=8192, block_tokens=128) is None
    assert catalog.best_match([_record(("z",))], ("h1",), max_tokens=8192, block_tokens=128) is None


def test_shared_record_round_trips_and_refuses_damage() -> None:
    record = _record(("h1", "h2"), uploaded=3.5)
    assert records.SharedRecord.from_json(record.to_json()) == record
    with pytest.raises(ValueError, match="chain"):
        records.SharedRecord.from_json(record.to_json().replace('"chain": ["h1", "h2"]', '"chain": [1]'))
    with pytest.raises(ValueError, match="format"):
        records.SharedRecord.from_json(record.to_json().replace('"format": 1', '"format": 9'))


# ---- fetch or prefill -----------------------------------------------------------------


def test_fetch_wins_when_the_transfer_is_clearly_shorter_than_the_prefill() -> None:
    # 12,000 tokens at 400 t/s = 30 s of prefill; 45 MB at 25 MB/s = 1.8 s of transfer
    est = decide.fetch_or_prefill(size=45_000_000, saved_tokens=12_000, bandwidth=25e6, prefill_rate=400)
    assert est.verdict is decide.Verdict.FETCH
    assert est.prefill_seconds == pytest.approx(30.0)
    assert est.fetch_seconds == pytest.approx(1.8 + decide.FETCH_OVERHEAD)


def test_prefill_wins_on_a_slow_link_or_a_fast_prefill() -> None:
    # a GPU prefilling 20,000 t/s: 4,000 tokens in 0.2 s beat any 20 MB download
    assert decide.fetch_or_prefill(size=20_000_000, saved_tokens=4000, bandwidth=1e9, prefill_rate=20_000).verdict is (
        decide.Verdict.PREFILL
    )
    # 2.7 GB over 10 MB/s (270 s) against 50,000 tokens at 400 t/s (125 s)
    assert decide.fetch_or_prefill(
        size=2_700_000_000, saved_tokens=50_000, bandwidth=10e6, prefill_rate=400
    ).verdict is (decide.Verdict.PREFILL)
    assert (
        decide.fetch_or_prefill(size=1, saved_tokens=0, bandwidth=1e9, prefill_rate=1).verdict is decide.Verdict.PREFILL
    )


def test_rate_starts_at_the_default_and_follows_measured_transfers() -> None:
    rate = decide.Rate()
    assert rate.current() == decide.DEFAULT_BANDWIDTH
    rate.add(100_000_000, 1.0)
    assert rate.current() == pytest.approx(100e6)
    rate.add(10_000_000, 1.0)
    assert rate.current() == pytest.approx(0.3 * 10e6 + 0.7 * 100e6)
    rate.add(0, 0.0)  # nothing measured
    assert rate.current() == pytest.approx(0.3 * 10e6 + 0.7 * 100e6)


def test_prefill_rate_is_the_servers_own_once_it_prefilled_enough() -> None:
    assert decide.prefill_rate(prompt_tokens=0, prompt_seconds=0) == decide.DEFAULT_PREFILL_RATE
    few = decide.MIN_MEASURED_TOKENS - 1
    assert decide.prefill_rate(prompt_tokens=few, prompt_seconds=0.001) == decide.DEFAULT_PREFILL_RATE
    assert decide.prefill_rate(prompt_tokens=6000, prompt_seconds=0) == decide.DEFAULT_PREFILL_RATE
    assert decide.prefill_rate(prompt_tokens=6000, prompt_seconds=12.0) == pytest.approx(500.0)


# ---- gc plan --------------------------------------------------------------------------

NS = "team/gemma-0123"
HOUR = 3600.0


def _obj(kind: str, cid: str, *, age: float, size: int = 0, now: float = 100 * HOUR) -> objstore.ObjectInfo:
    suffix = {"manifests": ".json", "blobs": ".bin", "gone": ""}[kind]
    return objstore.ObjectInfo(f"{NS}/{kind}/{cid}{suffix}", size, now - age)


def test_gc_unpublishes_by_age_and_keeps_the_blob_through_the_grace_period() -> None:
    now = 100 * HOUR
    objs = [_obj("manifests", "old", age=50 * HOUR), _obj("blobs", "old", age=50 * HOUR, size=10)]
    objs += [_obj("manifests", "new", age=HOUR), _obj("blobs", "new", age=HOUR, size=10)]
    plan = gc.plan(objs, now=now, max_age=24 * HOUR, max_bytes=0, grace=HOUR)
    assert plan.unpublish == (f"{NS}/manifests/old.json",)
    assert plan.delete == ()  # a node may have read the manifest a moment ago: the blob stays this run
    assert plan.kept_bytes == 10


def test_gc_deletes_a_blob_once_its_tombstone_is_older_than_the_grace() -> None:
    now = 100 * HOUR
    blob = _obj("blobs", "old", age=50 * HOUR, size=10)
    fresh = gc.plan([blob, _obj("gone", "old@1", age=0.5 * HOUR)], now=now, max_age=HOUR, max_bytes=0, grace=HOUR)
    assert fresh.delete == ()
    stale = gc.plan([blob, _obj("gone", "old@1", age=2 * HOUR)], now=now, max_age=HOUR, max_bytes=0, grace=HOUR)
    assert stale.delete == (blob.key, f"{NS}/gone/old@1")


def test_gc_never_deletes_a_blob_a_manifest_names() -> None:
    now = 100 * HOUR
    objs = [_obj("manifests", "a", age=99 * HOUR), _obj("blobs", "a", age=99 * HOUR, size=10)]
    objs.append(_obj("gone", "a@1", age=50 * HOUR))  # unpublished once, then uploaded again
    plan = gc.plan(objs, now=now, max_age=0, max_bytes=0, grace=HOUR)
    assert plan.unpublish == ()
    assert plan.delete == (f"{NS}/gone/a@1",)


def test_gc_byte_cap_drops_the_oldest_first() -> None:
    now = 100 * HOUR
    objs = []
    for i, age in enumerate((3, 2, 1)):
        objs += [_obj("manifests", f"s{i}", age=age * HOUR), _obj("blobs", f"s{i}", age=age * HOUR, size=100)]
    plan = gc.plan(objs, now=now, max_age=0, max_bytes=250, grace=HOUR)
    assert plan.unpublish == (f"{NS}/manifests/s0.json",)
    assert plan.kept_bytes == 200


def test_gc_removes_orphan_blobs_of_dead_uploads_only_after_the_grace() -> None:
    now = 100 * HOUR
    young, old = _obj("blobs", "young", age=60.0, size=5), _obj("blobs", "old", age=2 * HOUR, size=5)
    plan = gc.plan([young, old], now=now, max_age=0, max_bytes=0, grace=HOUR)
    assert plan.delete == (old.key,)


def test_a_node_that_has_not_measured_its_rate_takes_the_snapshots_then_its_own_kept_one() -> None:
    pick = decide.pick_prefill_rate
    assert pick(server=900.0, snapshot=400.0, kept=300.0) == (900.0, decide.RateSource.SERVER)
    assert pick(server=None, snapshot=400.0, kept=300.0) == (400.0, decide.RateSource.SNAPSHOT)
    assert pick(server=None, snapshot=None, kept=300.0) == (300.0, decide.RateSource.KEPT)
    assert pick(server=None, snapshot=0.0, kept=None) == (decide.DEFAULT_PREFILL_RATE, decide.RateSource.DEFAULT)
    # the case of the field: 1,408 tokens, 12.6 MB; prefill at the default looked cheaper than the fetch
    at_default = decide.fetch_or_prefill(size=12_600_000, saved_tokens=1408, bandwidth=25e6, prefill_rate=5000)
    at_origin = decide.fetch_or_prefill(size=12_600_000, saved_tokens=1408, bandwidth=25e6, prefill_rate=400)
    assert (at_default.verdict, at_origin.verdict) == (decide.Verdict.PREFILL, decide.Verdict.FETCH)
