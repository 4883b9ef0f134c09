"""manifest.Manifest (de)serialisation of formats 1 and 2, ordering, and manifest.incompatibilities."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import pytest

from sidecar.core import events, hashing
from sidecar.snapshots import manifest

IDENTITY = events.Identity(
    build_info="b515-515e85511",
    model_path="/models/gemma3-270m.gguf",
    total_slots=4,
    n_ctx=16384,
    model_size=253_000_000,
    model_params=268_000_000,
    weights="xxh3-128:" + "0f" * 16,
    adapters=(events.Adapter(0, "/models/style.gguf", 0.5),),
)
GOOD = manifest.Manifest(
    slot=2,
    file="slot2-20251129T111213123456Z.bin",
    tokens=4001,
    bytes=20_000_000,
    checksum=manifest.Checksum(hashing.Algorithm.XXH3_128, "ab" * 16),
    generation=7,
    created=1_764_414_733.123456,
    task=17,
    fingerprint=manifest.Fingerprint.of(IDENTITY, n_ctx=4096),
)


def raw() -> dict[str, Any]:
    body: dict[str, Any] = json.loads(GOOD.to_json())
    return body


def test_round_trip() -> None:
    assert manifest.Manifest.from_json(GOOD.to_json()) == GOOD


def test_round_trip_with_unknowns() -> None:
    fp = dataclasses.replace(GOOD.fingerprint, model_size=None, model_params=None, weights=None, adapters=None)
    m = dataclasses.replace(GOOD, task=None, fingerprint=fp)
    assert manifest.Manifest.from_json(m.to_json()) == m


def test_json_records_format_and_fingerprint() -> None:
    body = raw()
    assert body["format"] == manifest.FORMAT == 2
    assert body["checksum"] == {"algorithm": "xxh3-128", "digest": "ab" * 16}
    assert body["generation"] == 7
    assert "sha256" not in body
    assert body["fingerprint"] == {
        "build_info": "b515-515e85511",
        "model_path": "/models/gemma3-270m.gguf",
        "model_size": 253_000_000,
        "model_params": 268_000_000,
        "n_ctx": 4096,
        "total_slots": 4,
        "weights": "xxh3-128:" + "0f" * 16,
        "adapters": [{"id": 0, "path": "/models/style.gguf", "scale": 0.5}],
        "memory": None,
    }


def _del(*path: str) -> Callable[[dict[str, Any]], None]:
    def mutate(body: dict[str, Any]) -> None:
        target = body
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]

    return mutate


def _set(value: Any, *path: str) -> Callable[[dict[str, Any]], None]:
    def mutate(body: dict[str, Any]) -> None:
        target = body
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return mutate


MALFORMED: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("format missing", _del("format"), "format"),
    ("format 0", _set(0, "format"), "format"),
    ("format string", _set("2", "format"), "format"),
    ("slot missing", _del("slot"), "'slot'"),
    ("slot string", _set("2", "slot"), "'slot'"),
    ("slot bool", _set(True, "slot"), "'slot'"),
    ("slot negative", _set(-1, "slot"), "'slot'"),
    ("file missing", _del("file"), "'file'"),
    ("file int", _set(7, "file"), "'file'"),
    ("tokens missing", _del("tokens"), "'tokens'"),
    ("tokens float", _set(1.5, "tokens"), "'tokens'"),
    ("tokens negative", _set(-3, "tokens"), "'tokens'"),
    ("bytes missing", _del("bytes"), "'bytes'"),
    ("bytes string", _set("20MB", "bytes"), "'bytes'"),
    ("checksum missing", _del("checksum"), "'checksum'"),
    ("checksum algorithm unknown", _set("md5", "checksum", "algorithm"), "'md5'"),
    ("checksum digest int", _set(5, "checksum", "digest"), "'digest'"),
    ("checksum digest short", _set("abc", "checksum", "digest"), "checksum digest"),
    ("checksum digest upper hex", _set("AB" * 16, "checksum", "digest"), "checksum digest"),
    ("checksum digest of sha256 length", _set("ab" * 32, "checksum", "digest"), "checksum digest"),
    ("generation missing", _del("generation"), "'generation'"),
    ("generation negative", _set(-1, "generation"), "'generation'"),
    ("weights int", _set(5, "fingerprint", "weights"), "'weights'"),
    ("adapters object", _set({}, "fingerprint", "adapters"), "'adapters'"),
    ("adapter scale string", _set([{"id": 0, "path": "/a", "scale": "1"}], "fingerprint", "adapters"), "'scale'"),
    ("created missing", _del("created"), "'created'"),
    ("created string", _set("yesterday", "created"), "'created'"),
    ("created bool", _set(False, "created"), "'created'"),
    ("task string", _set("17", "task"), "'task'"),
    ("fingerprint missing", _del("fingerprint"), "'fingerprint'"),
    ("fingerprint list", _set([], "fingerprint"), "'fingerprint'"),
    ("build_info missing", _del("fingerprint", "build_info"), "'build_info'"),
    ("model_path int", _set(1, "fingerprint", "model_path"), "'model_path'"),
    ("model_size string", _set("big", "fingerprint", "model_size"), "'model_size'"),
    ("model_params negative", _set(-1, "fingerprint", "model_params"), "'model_params'"),
    ("n_ctx missing", _del("fingerprint", "n_ctx"), "'n_ctx'"),
    ("total_slots null", _set(None, "fingerprint", "total_slots"), "'total_slots'"),
    ("created NaN", _set(float("nan"), "created"), "NaN"),
    ("created Infinity", _set(float("inf"), "created"), "Infinity"),
    ("created past year 9999", _set(1e300, "created"), "'created'"),
    ("created 2**63", _set(2**63, "created"), "'created'"),
    ("created negative", _set(-1.0, "created"), "'created'"),
    ("prefill_rate -Infinity", _set(float("-inf"), "prefill_rate"), "-Infinity"),
    ("tokens 2**63", _set(2**63, "tokens"), "'tokens'"),
    ("generation 2**63", _set(2**63, "generation"), "'generation'"),
    ("model_params 10**400", _set(10**400, "fingerprint", "model_params"), "'model_params'"),
    ("adapter scale NaN", _set([{"id": 0, "path": "/a", "scale": float("nan")}], "fingerprint", "adapters"), "NaN"),
]


@pytest.mark.parametrize(("mutate", "names"), [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_from_json_rejects_each_malformed_field(mutate: Callable[[dict[str, Any]], None], names: str) -> None:
    body = raw()
    mutate(body)
    with pytest.raises(ValueError, match="manifest") as info:
        manifest.Manifest.from_json(json.dumps(body))
    assert names in str(info.value)


@pytest.mark.parametrize("text", ["[]", "42", '"slot2"', "null"])
def test_from_json_rejects_non_objects(text: str) -> None:
    with pytest.raises(ValueError, match="not a JSON object"):
        manifest.Manifest.from_json(text)


def test_from_json_rejects_non_json() -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - json.JSONDecodeError is a ValueError; that is the contract
        manifest.Manifest.from_json('{"slot": 2,')


@pytest.mark.parametrize(
    "file",
    [
        "slot1-20251129T111213123456Z.bin",  # another slot's file
        "slot2-20251129T111213Z.bin",  # wrong stamp
        "../slot2-20251129T111213123456Z.bin",  # not a bare name
        "slot2-20251129T111213123456Z.json",
        ".tmp-slot2-abcdef.bin",
    ],
)
def test_from_json_rejects_file_name_slot_mismatch(file: str) -> None:
    body = raw()
    body["file"] = file
    with pytest.raises(ValueError, match="not a snapshot of slot 2") as info:
        manifest.Manifest.from_json(json.dumps(body))
    assert repr(file) in str(info.value)


# ---- incompatibilities ---------------------------------------------------------------


def test_compatible_is_empty() -> None:
    assert manifest.incompatibilities(GOOD, IDENTITY, slot_n_ctx=4096) == []


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("build_info", "b999-deadbeef"),
        ("model_path", "/models/other.gguf"),
        ("model_size", 1),
        ("model_params", 2),
    ],
)
def test_each_differing_field_is_named(field: str, value: object) -> None:
    changes: dict[str, Any] = {field: value}
    server = dataclasses.replace(IDENTITY, **changes)
    problems = manifest.incompatibilities(GOOD, server, slot_n_ctx=4096)
    assert len(problems) == 1
    assert problems[0].startswith(f"{field}: ")
    assert repr(getattr(GOOD.fingerprint, field)) in problems[0]
    assert repr(value) in problems[0]


def test_slot_beyond_the_servers_slots() -> None:
    problems = manifest.incompatibilities(GOOD, dataclasses.replace(IDENTITY, total_slots=2), slot_n_ctx=4096)
    assert len(problems) == 1
    assert problems[0].startswith("total_slots: ")


def test_tokens_not_fitting_the_slot_context() -> None:
    problems = manifest.incompatibilities(GOOD, IDENTITY, slot_n_ctx=4000)
    assert len(problems) == 1
    assert problems[0].startswith("n_ctx: ")
    assert "4001" in problems[0]
    assert "4000" in problems[0]
    assert manifest.incompatibilities(GOOD, IDENTITY, slot_n_ctx=4001) == []


def test_every_difference_is_listed() -> None:
    server = events.Identity("other", "/x.gguf", 1, 512, 1, 1)
    fields = [p.split(":")[0] for p in manifest.incompatibilities(GOOD, server, slot_n_ctx=512)]
    assert fields == ["build_info", "model_path", "model_size", "model_params", "total_slots", "n_ctx"]


def test_unknown_model_size_on_either_side_is_not_a_difference() -> None:
    unknown_server = dataclasses.replace(IDENTITY, model_size=None, model_params=None)
    assert manifest.incompatibilities(GOOD, unknown_server, slot_n_ctx=4096) == []
    fp = dataclasses.replace(GOOD.fingerprint, model_size=None, model_params=None)
    assert manifest.incompatibilities(dataclasses.replace(GOOD, fingerprint=fp), IDENTITY, slot_n_ctx=4096) == []


def test_every_difference_is_listed_with_weights_and_adapters() -> None:
    server = events.Identity("other", "/x.gguf", 1, 512, 1, 1, weights="xxh3-128:" + "11" * 16, adapters=())
    fields = [p.split(":")[0] for p in manifest.incompatibilities(GOOD, server, slot_n_ctx=512)]
    assert fields == [
        "build_info",
        "model_path",
        "model_size",
        "model_params",
        "weights",
        "adapters",
        "total_slots",
        "n_ctx",
    ]


def test_other_weights_of_the_same_shape_are_named() -> None:
    # A fine-tune copied over the same file: same path, size and parameter count, other content.
    server = dataclasses.replace(IDENTITY, weights="xxh3-128:" + "22" * 16)
    (problem,) = manifest.incompatibilities(GOOD, server, slot_n_ctx=4096)
    assert problem.startswith("weights: ")
    assert GOOD.fingerprint.weights is not None
    assert GOOD.fingerprint.weights in problem
    assert server.weights is not None
    assert server.weights in problem


@pytest.mark.parametrize(
    "adapters",
    [(), (events.Adapter(0, "/models/style.gguf", 1.0),), (events.Adapter(0, "/models/other.gguf", 0.5),)],
    ids=["none loaded", "other scale", "other file"],
)
def test_other_lora_adapters_are_named(adapters: tuple[events.Adapter, ...]) -> None:
    server = dataclasses.replace(IDENTITY, adapters=adapters)
    (problem,) = manifest.incompatibilities(GOOD, server, slot_n_ctx=4096)
    assert problem.startswith("adapters: snapshot [0:/models/style.gguf@0.5], server ")


def test_weights_unknown_on_either_side_fall_back_to_the_older_fields() -> None:
    unread = dataclasses.replace(IDENTITY, weights=None, adapters=None)
    assert manifest.incompatibilities(GOOD, unread, slot_n_ctx=4096) == []
    fp = dataclasses.replace(GOOD.fingerprint, weights=None, adapters=None)
    assert manifest.incompatibilities(dataclasses.replace(GOOD, fingerprint=fp), IDENTITY, slot_n_ctx=4096) == []


# ---- formats -------------------------------------------------------------------------

FORMAT_1 = {
    "format": 1,
    "slot": 2,
    "file": "slot2-20251129T111213123456Z.bin",
    "tokens": 4001,
    "bytes": 20_000_000,
    "sha256": "cd" * 32,
    "created": 1_764_414_733.5,
    "task": 17,
    "fingerprint": {
        "build_info": "b515-515e85511",
        "model_path": "/models/gemma3-270m.gguf",
        "model_size": 253_000_000,
        "model_params": 268_000_000,
        "n_ctx": 4096,
        "total_slots": 4,
    },
}


def test_format_1_reads_as_generation_0_with_its_sha256() -> None:
    old = manifest.Manifest.from_json(json.dumps(FORMAT_1))
    assert old.checksum == manifest.Checksum(hashing.Algorithm.SHA256, "cd" * 32)
    assert old.generation == 0
    assert (old.fingerprint.weights, old.fingerprint.adapters) == (None, None)
    assert manifest.incompatibilities(old, IDENTITY, slot_n_ctx=4096) == []  # still restorable


@pytest.mark.parametrize(("key", "value"), [("sha256", "CD" * 32), ("sha256", "cd" * 16)])
def test_format_1_with_a_bad_sha256_is_damaged(key: str, value: str) -> None:
    with pytest.raises(ValueError, match="sha256"):
        manifest.Manifest.from_json(json.dumps({**FORMAT_1, key: value}))


@pytest.mark.parametrize("found", [3, 17])
def test_a_newer_format_is_not_damage(found: int) -> None:
    body = {**raw(), "format": found, "some_future_field": [1, 2]}
    with pytest.raises(manifest.NewerFormatError) as info:
        manifest.Manifest.from_json(json.dumps(body))
    assert not isinstance(info.value, ValueError)  # callers quarantine on ValueError only
    assert info.value.found == found


def test_newest_first_orders_by_generation_not_by_clock() -> None:
    older_clock_newer_gen = dataclasses.replace(GOOD, generation=9, created=1_000.0)
    newer_clock_older_gen = dataclasses.replace(GOOD, generation=8, created=2_000_000_000.0)
    format_1_late = dataclasses.replace(GOOD, generation=0, created=2_100_000_000.0)
    format_1_early = dataclasses.replace(GOOD, generation=0, created=900.0)
    given = [format_1_early, newer_clock_older_gen, format_1_late, older_clock_newer_gen]
    assert manifest.newest_first(given) == [older_clock_newer_gen, newer_clock_older_gen, format_1_late, format_1_early]


def test_the_writing_servers_prefill_rate_is_kept_and_a_bad_one_refused() -> None:
    m = dataclasses.replace(GOOD, prefill_rate=412.5)
    assert manifest.Manifest.from_json(m.to_json()) == m
    assert manifest.Manifest.from_json(GOOD.to_json()).prefill_rate is None
    body = json.loads(m.to_json())
    body["prefill_rate"] = "fast"
    with pytest.raises(ValueError, match="prefill_rate"):
        manifest.Manifest.from_json(json.dumps(body))
