"""The proxy's path decoder against llama-server's (cpp-httplib 0.59), and what each spelling is classified as."""

from __future__ import annotations

import pytest

from sidecar.core import outcomes
from sidecar.proxy import pathcode, predict, routes

C = outcomes.Route.COMPLETION
O = outcomes.Route.OTHER  # noqa: E741
V = routes.Verdict


@pytest.mark.parametrize(
    ("raw", "decoded"),
    [
        (b"/slots/0", b"/slots/0"),
        (b"/%73lots/0", b"/slots/0"),
        (b"/%53LOTS/0", b"/SLOTS/0"),
        (b"/%u0073lots/0", b"/slots/0"),  # the %u escape urllib.parse.unquote leaves as it is
        (b"/%u0053lots", b"/Slots"),
        (b"/%U0073lots", b"/%U0073lots"),  # upper-case U: not an escape for cpp-httplib
        (b"/sl%uD800ots/0", b"/slots/0"),  # a surrogate decodes to nothing at all
        (b"/sl%uDFFFots/0", b"/slots/0"),
        (b"/%u00e9", "/\u00e9".encode()),
        (b"/%uFFFF", "/\uffff".encode()),
        (b"/slots%2F0", b"/slots/0"),
        (b"/slots%2f0", b"/slots/0"),
        (b"/%2573lots/0", b"/%73lots/0"),  # decoded once, never twice
        (b"/%C0%AF", b"/\xc0\xaf"),  # overlong UTF-8 stays two bytes
        (b"/x%00y", b"/x\x00y"),
        (b"/%zz", b"/%zz"),
        (b"/%4", b"/%4"),
        (b"/%", b"/%"),
        (b"/%u12", b"/%u12"),
        (b"/%u12G4", b"/%u12G4"),
        (b"/%5c", b"/\\"),
        (b"/a+b", b"/a+b"),  # '+' is a space in a query, not in a path
    ],
)
def test_paths_decode_as_cpp_httplib_decodes_them(raw: bytes, decoded: bytes) -> None:
    assert pathcode.decode(raw) == decoded
    assert pathcode.decode(pathcode.encode(decoded).encode()) == decoded, "the canonical form decodes the same"


@pytest.mark.parametrize(
    ("method", "target", "route", "verdict", "sent"),
    [
        ("POST", "/completion", C, V.FORWARD, "/completion"),
        ("POST", "/v1/chat/completions?x=1", C, V.FORWARD, "/v1/chat/completions?x=1"),
        ("POST", "/v1/chat/%63ompletions", C, V.FORWARD, "/v1/chat/completions"),
        ("POST", "/v1/chat/%u0063ompletions", C, V.FORWARD, "/v1/chat/completions"),
        ("POST", "/v1/messages", C, V.FORWARD, "/v1/messages"),
        ("POST", "/infill", C, V.FORWARD, "/infill"),
        ("POST", "/v1/embeddings", C, V.FORWARD, "/v1/embeddings"),
        ("POST", "/v1/systemone", C, V.FORWARD, "/v1/systemone"),
        ("POST", "/predict?id_slot=1&action=save", C, V.PREDICT, "/predict?id_slot=1&action=save"),
        ("POST", "/%70redict", C, V.PREDICT, "/predict"),
        ("POST", "/tokenize", O, V.FORWARD, "/tokenize"),
        ("POST", "/v1/messages/count_tokens", O, V.FORWARD, "/v1/messages/count_tokens"),
        ("DELETE", "/v1/stream?id=1", O, V.FORWARD, "/v1/stream?id=1"),
        ("GET", "/completion", O, V.FORWARD, "/completion"),
        ("GET", "/slots", O, V.FORWARD, "/slots"),
        ("GET", "/", O, V.FORWARD, "/"),
        ("GET", "/bundle.js#x", O, V.FORWARD, "/bundle.js"),
        ("OPTIONS", "/slots/0", O, V.FORWARD, "/slots/0"),
        # every spelling llama-server routes to POST /slots/:id_slot
        ("POST", "/slots/0?action=save", O, V.SLOT_ACTION, "/slots/0?action=save"),
        ("POST", "/%u0073lots/0?action=erase", O, V.SLOT_ACTION, "/slots/0?action=erase"),
        ("POST", "/%73lots/1?action=save", O, V.SLOT_ACTION, "/slots/1?action=save"),
        ("POST", "/sl%uD800ots/0?action=erase", O, V.SLOT_ACTION, "/slots/0?action=erase"),
        ("POST", "/slots%2F0?action=erase", O, V.SLOT_ACTION, "/slots/0?action=erase"),
        ("POST", "/slots/0/?action=erase", O, V.SLOT_ACTION, "/slots/0/?action=erase"),
        ("POST", "/slots/0;x?action=erase", O, V.SLOT_ACTION, "/slots/0;x?action=erase"),
        ("POST", "/slots/?action=erase", O, V.SLOT_ACTION, "/slots/?action=erase"),
        ("POST", "/slots/0#frag?action=erase", O, V.SLOT_ACTION, "/slots/0"),
        # spellings llama-server does not route: refused unless admin (default-deny)
        ("POST", "/SLOTS/0?action=erase", O, V.UNKNOWN, "/SLOTS/0?action=erase"),
        ("POST", "/%U0073lots/0?action=erase", O, V.BAD_PATH, ""),
        ("POST", "/v1//slots/0?action=erase", O, V.UNKNOWN, "/v1//slots/0?action=erase"),
        ("POST", "/api/slots/0?action=erase", O, V.UNKNOWN, "/api/slots/0?action=erase"),
        ("POST", "/slots", O, V.UNKNOWN, "/slots"),
        ("POST", "/slots;/0", O, V.UNKNOWN, "/slots;/0"),
        ("POST", "/completion/", O, V.UNKNOWN, "/completion/"),
        ("PUT", "/slots/0?action=erase", O, V.UNKNOWN, "/slots/0?action=erase"),
        ("DELETE", "/slots/0", O, V.UNKNOWN, "/slots/0"),
        ("post", "/slots/0", O, V.UNKNOWN, "/slots/0"),
        ("POST", "/v1/some/post", O, V.UNKNOWN, "/v1/some/post"),
        ("POST", "/predictx", O, V.UNKNOWN, "/predictx"),
        # refused outright (400)
        ("POST", "/slots/%2530?action=save", O, V.BAD_PATH, ""),  # double encoding: '%' after one decode
        ("POST", "/../slots/0", O, V.BAD_PATH, ""),
        ("POST", "/a/%2e/completion", O, V.BAD_PATH, ""),
        ("POST", "/a/%2E%2E/slots/0", O, V.BAD_PATH, ""),
        ("POST", "/a\\..\\slots/0", O, V.BAD_PATH, ""),
        ("POST", "/slots%5c0", O, V.BAD_PATH, ""),
        ("POST", "/slots/0%00", O, V.BAD_PATH, ""),
        ("POST", "/%C0%AFslots/0", O, V.BAD_PATH, ""),
        ("POST", "/slots/\u0660", O, V.BAD_PATH, ""),
        ("POST", "/slots%20/0", O, V.BAD_PATH, ""),
        ("POST", "/completion%3Fx", O, V.BAD_PATH, ""),
        ("POST", "//slots/0?action=erase", O, V.BAD_PATH, ""),
        ("GET", "http://example.com/health", O, V.BAD_PATH, ""),
        ("GET", "*", O, V.BAD_PATH, ""),
    ],
)
def test_requests_are_classified_on_the_path_llama_server_routes_and_sent_in_canonical_form(
    method: str, target: str, route: outcomes.Route, verdict: routes.Verdict, sent: str
) -> None:
    kind = routes.classify(method, target)
    assert (kind.route, kind.verdict, kind.target) == (route, verdict, sent)
    if sent:
        # what llama-server routes from what the proxy sends is what the proxy classified
        assert pathcode.decode(sent.partition("?")[0].encode()).decode() == kind.path


@pytest.mark.parametrize(
    ("body", "check"),
    [
        (b'{"instances": [{"@requestFormat": "chatCompletions", "messages": []}]}', predict.Check.ALLOWED),
        (b'{"instances": [{"@requestFormat": "/v1/completions", "prompt": "x"}]}', predict.Check.ALLOWED),
        (b'{"instances": [{"@requestFormat": "tokenize"}, {"@requestFormat": "health"}]}', predict.Check.ALLOWED),
        (b'{"instances": [{"@requestFormat": "/slots/:id_slot", "filename": "a.bin"}]}', predict.Check.SLOT_ACTION),
        (b'{"instances": [{"@requestFormat": "slots"}]}', predict.Check.SLOT_ACTION),
        (b'{"instances": [{"@requestFormat": "tokenize"}, {"@requestFormat": "slots"}]}', predict.Check.SLOT_ACTION),
        (b'{"instances": [{"\\u0040requestFormat": "slots"}]}', predict.Check.SLOT_ACTION),
        (b'{"instances": [{"@requestFormat": "/slots/0"}]}', predict.Check.SLOT_ACTION),
        (b'{"instances": [{"@requestFormat": "/slots"}]}', predict.Check.UNKNOWN),
        (b'{"instances": [{"@requestFormat": "nothing"}]}', predict.Check.UNKNOWN),
        (
            b'{"instances": [{"@requestFormat": "tokenize", "@requestFormat": "slots"}]}',
            predict.Check.UNREADABLE,
        ),
        (b'{"instances": [{"@requestFormat": 1}]}', predict.Check.UNREADABLE),
        (b'{"instances": [{"@requestFormat": "tokenize", "x": NaN}]}', predict.Check.UNREADABLE),
        (b'{"instances": {"@requestFormat": "tokenize"}}', predict.Check.UNREADABLE),
        (b'{"instances": [{"@requestFormat": "tokenize"}]} x', predict.Check.UNREADABLE),
        (b'{"instances": [{"@requestFormat": "tok\xffenize"}]}', predict.Check.UNREADABLE),
        (b"[]", predict.Check.UNREADABLE),
    ],
)
def test_predict_bodies_are_checked_for_slot_formats(body: bytes, check: predict.Check) -> None:
    assert predict.check(body) is check


@pytest.mark.parametrize(
    ("path", "alias"),
    [
        ("/v1/chat/completions", "chatCompletions"),
        ("/apply-template", "applyTemplate"),
        ("/slots/:id_slot", "slots"),
        ("/v1/messages/count_tokens", "messagesCountTokens"),
        ("/v1", "v1"),
    ],
)
def test_predict_aliases_are_derived_as_llama_server_derives_them(path: str, alias: str) -> None:
    assert predict.gcp_format(path) == alias
