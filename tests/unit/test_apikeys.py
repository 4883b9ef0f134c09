"""API keys as the proxy checks them (as llama-server does), key files with pools, and owners' fingerprints."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from sidecar.cli import main as cli
from sidecar.cli import parsing
from sidecar.core import apikeys, errors, parse
from sidecar.library import prompt
from sidecar.snapshots import manifest
from tests.unit import test_manifest

KEYS = apikeys.Keys(("sk-first", "sk-second"))


@pytest.mark.parametrize(
    ("authorization", "x_api_key", "accepted"),
    [
        ("Bearer sk-first", None, "sk-first"),
        ("Bearer sk-second", None, "sk-second"),
        ("sk-second", None, "sk-second"),  # llama-server strips "Bearer " only if it is there
        (None, "sk-first", "sk-first"),  # Anthropic clients' header, read when Authorization is empty
        ("", "Bearer sk-first", "sk-first"),
        ("Bearer sk-wrong", "sk-first", None),  # a non-empty Authorization is the one read
        ("bearer sk-first", None, None),  # the prefix is matched as spelled
        ("Bearer  sk-first", None, None),  # one space
        ("Basic sk-first", None, None),
        ("Bearer sk-firs", None, None),
        ("Bearer sk-first\udcff", None, None),  # a byte that is not UTF-8, as aiohttp hands it over
        (None, None, None),
    ],
)
def test_a_key_is_read_and_matched_as_llama_server_reads_it(
    authorization: str | None, x_api_key: str | None, accepted: str | None
) -> None:
    owner = KEYS.check(authorization, x_api_key)
    assert owner == (apikeys.owner_of(key=accepted) if accepted is not None else None)


def test_an_owner_is_a_fingerprint_that_tells_keys_and_pools_apart_and_holds_no_key() -> None:
    owners = {apikeys.owner_of(key="sk-a"), apikeys.owner_of(key="sk-b"), apikeys.owner_of(pool="sk-a")}
    assert len(owners) == 3
    assert all(len(o) == 32 and "sk-" not in o for o in owners)
    assert apikeys.owner_of(key="sk-a") == apikeys.owner_of(key="sk-a")  # the same on every node, every start
    assert apikeys.NOBODY not in owners


def test_a_key_file_gives_its_keys_in_order_and_the_pools_its_pool_lines_set() -> None:
    lines = ["# llama-server's format", "# pool: team", "sk-t1", "sk-t2", "# pool:", "sk-own", "", "#sk-commented"]
    found = apikeys.of_file(lines)
    assert found is not None
    assert found.keys == ("sk-t1", "sk-t2", "sk-own")
    assert found.first == "sk-t1"
    team = apikeys.owner_of(pool="team")
    assert found.check("Bearer sk-t1", None) == team
    assert found.check("Bearer sk-t2", None) == team
    assert found.check("Bearer sk-own", None) == apikeys.owner_of(key="sk-own")
    assert found.check("Bearer #sk-commented", None) is None
    assert apikeys.of_file(["# only comments", ""]) is None


def test_the_flags_keep_every_key_for_the_proxy_and_send_the_first(tmp_path: Path) -> None:
    sent, listed = parse.first_key("sk-one,sk-two")
    assert sent == "sk-one"
    assert listed is not None
    assert listed.keys == ("sk-one", "sk-two")
    assert parse.first_key("") == (None, None)
    key_file = tmp_path / "keys"
    key_file.write_text("# pool: ops\nsk-ops\n# pool:\nsk-mine\n")
    ns = cli.build_parser().parse_args(["run", "--slot-dir", str(tmp_path), "--api-key-file", str(key_file)])
    settings = parsing.settings_from(ns)
    assert settings.upstream.api_key == "sk-ops"
    assert settings.upstream.keys is not None
    assert settings.upstream.keys.check("sk-mine", None) == apikeys.owner_of(key="sk-mine")
    key_file.write_text("# no key here\n")
    with pytest.raises(errors.ConfigError, match="holds no key"):
        parse.key_file(str(key_file))


@pytest.mark.parametrize(
    ("path", "body", "sent"),
    [
        ("/v1/chat/completions", b'{"messages": []}', {"cache_prompt": False, "messages": []}),
        ("/completion", b' {"prompt": "x", "cache_prompt": true}', {"prompt": "x", "cache_prompt": False}),
        ("/v1/responses", b'{"input": "x"}', {"cache_prompt": False, "input": "x"}),
    ],
)
def test_a_request_kept_off_other_owners_kv_is_sent_with_cache_prompt_off_whatever_the_client_said(
    path: str, body: bytes, sent: dict[str, object]
) -> None:
    out = prompt.uncached(path, body)
    assert json.loads(out) == sent
    if b"cache_prompt" not in body:
        assert out.endswith(body.lstrip()[1:])  # the rest goes byte for byte


def test_where_the_route_drops_the_field_or_the_body_is_no_object_it_goes_as_it_came() -> None:
    assert prompt.uncached("/v1/messages", b'{"messages": []}') == b'{"messages": []}'
    assert prompt.uncached("/completion", b"[1, 2]") == b"[1, 2]"
    assert prompt.uncached("/completion", b"not json") == b"not json"


def test_a_manifest_keeps_its_owner_and_one_written_before_owners_belongs_to_no_key() -> None:
    owner = apikeys.owner_of(key="sk-a")
    again = manifest.Manifest.from_json(dataclasses.replace(test_manifest.GOOD, owner=owner).to_json())
    assert again.owner == owner
    body = json.loads(test_manifest.GOOD.to_json())
    del body["owner"]
    assert manifest.Manifest.from_json(json.dumps(body)).owner == apikeys.NOBODY
    body["owner"] = 5
    with pytest.raises(ValueError, match="owner"):
        manifest.Manifest.from_json(json.dumps(body))
