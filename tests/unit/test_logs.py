"""sidecar.core.logs and redact: no log line carries a secret, a traceback's locals included, in either format."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import structlog

from sidecar.core import logs, redact

TOKEN = "admin-Zq81xVb0mT4kLp29"
KEY = "sk-llama-6c0ffee5"
UNKNOWN = "tok-the-sidecar-never-heard-of"
LOCAL = "a-local-value-7f3a"


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        yield
    finally:
        structlog.reset_defaults()
        root.handlers[:] = handlers
        root.setLevel(level)


def _handle(authorization: str) -> None:
    token = authorization.removeprefix("Bearer ")  # a local holding the secret, as a request handler's would
    shown = LOCAL  # a local no redaction touches: in the line only if the traceback shows locals
    raise UnicodeEncodeError("utf-8", token, 0, len(shown), "surrogates not allowed")


@pytest.mark.usefixtures("restore_logging")
@pytest.mark.parametrize("fmt", ["json", "console"])
def test_tracebacks_carry_no_locals_and_known_secrets_and_header_values_are_blanked(
    fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    logs.configure(fmt=fmt, level="info", secrets=(TOKEN, KEY))
    try:
        _handle(f"Bearer {TOKEN}")
    except UnicodeEncodeError:
        structlog.get_logger("t").exception("handler_failed", key=KEY)
        logging.getLogger("aiohttp.server").exception("Error handling request")  # the stdlib path, as aiohttp logs
    logging.getLogger("aiohttp.server").error("bad request: b'X-Api-Key: %s'", UNKNOWN)
    err = capsys.readouterr().err
    assert "handler_failed" in err
    assert "Error handling request" in err
    assert "bad request" in err
    assert err.count("UnicodeEncodeError") >= 2  # both tracebacks are there, with their frames
    assert "_handle" in err
    for secret in (TOKEN, KEY, UNKNOWN):
        assert secret not in err
    assert LOCAL not in err
    assert redact.REDACTED in err


def test_the_redactor_blanks_secrets_and_header_values_in_nested_values_and_keeps_placeholders() -> None:
    blank = redact.Redactor([TOKEN, "abc"])  # a secret of 3 characters is left to the header net
    event = {
        "event": f"saw {TOKEN} twice: {TOKEN}",
        "exception": [{"exc_value": "b'Authorization: Bearer \\x01tok-9'", "frames": [{"name": "f"}]}],
        "headers": ("{'x-api-key': 'k-9', 'Accept': 'abc'}",),
        "hint": "send 'Authorization: Bearer <admin token>'",
        "count": 3,
    }
    out = blank(None, "info", event)
    assert out["event"] == f"saw {redact.REDACTED} twice: {redact.REDACTED}"
    assert out["exception"] == [{"exc_value": f"b'Authorization: {redact.REDACTED}'", "frames": [{"name": "f"}]}]
    assert out["headers"] == (f"{{'x-api-key': '{redact.REDACTED}', 'Accept': 'abc'}}",)
    assert out["hint"] == "send 'Authorization: Bearer <admin token>'"
    assert out["count"] == 3


@pytest.mark.parametrize(
    ("given", "shown"),
    [
        ("http://watcher:s3cret@llama:8080/", "http://watcher:[redacted]@llama:8080/"),
        ("https://:s3cret@llama", "https://:[redacted]@llama"),
        ("http://we:ird@pw@10.0.0.2:8080", "http://we:[redacted]@10.0.0.2:8080"),
        ("http://watcher@llama:8080", "http://watcher@llama:8080"),
        ("http://127.0.0.1:8080", "http://127.0.0.1:8080"),
    ],
)
def test_a_urls_password_is_blanked_and_the_rest_kept(given: str, shown: str) -> None:
    assert redact.url(given) == shown
