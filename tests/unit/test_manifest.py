"""manifest.Manifest (de)serialisation and manifest.incompatibilities."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import pytest

from sidecar import events, manifest

IDENTITY = events.Identity(
    build_info="b515-515e85511",
    model_path="/models/gemma3-270m.gguf",
    total_slots=4,
    n_ctx=16384,
    model_size=253_000_000,
    model_params=268_000_000,
)
GOOD = manifest.Manifest(
    slot=2,
    file="slot2-20251129T111213123456Z.bin",
    tokens=4001,
    bytes=20_000_000,
    sha256="ab" * 32,
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
    fp = dataclasses.replace(GOOD.fingerprint, model_size=None, model_params=None)
    m = dataclasses.replace(GOOD, task=None, fingerprint=fp)
    assert manifest.Manifest.from_json(m.to_json()) == m


def test_json_records_format_and_fingerprint() -> None:
    body = raw()
    assert body["format"] == manifest.FORMAT
    assert body["fingerprint"] == {
        "build_info": "b515-515e85511",
        "model_path": "/models/gemma3-270m.gguf",
        "model_size": 253_000_000,
        "model_params": 268_000_000,
        "n_ctx": 4096,
        "total_slots": 4,
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
    ("format 2", _set(2, "format"), "format"),
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
    ("sha256 missing", _del("sha256"), "'sha256'"),
    ("sha256 int", _set(5, "sha256"), "'sha256'"),
    ("sha256 short", _set("abc", "sha256"), "sha256"),
    ("sha256 upper hex", _set("AB" * 32, "sha256"), "sha256"),
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
