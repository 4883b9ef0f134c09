"""Turning the text of a flag, environment variable or request parameter into a value.

Integers from ASCII digits only (:func:`integer`: Python's ``int`` and
``str.isdigit`` also take superscripts, other scripts' digits or ``1_000``), numbers with their
sign checked, on/off switches, llama-server's URL, the
listen address, API key lists as llama-server reads them, and the files that
hold secrets. Errors argparse can report are ``argparse.ArgumentTypeError``;
the others are ``errors.ConfigError`` with the flag named.
"""

from __future__ import annotations

import argparse
import csv
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from sidecar.core import apikeys, errors

_DIGITS = frozenset("0123456789")
MAX_DIGITS = 18
"""Longest integer read from outside: below 2**63, and no quadratic-time conversion of a huge text."""


def integer(text: str | bytes, *, signed: bool = False) -> int:
    """The integer ``text`` spells in ASCII digits (``-`` first if ``signed``); ``ValueError`` otherwise.

    No spaces, ``+``, ``_``, other scripts' digits or superscripts, at most
    ``MAX_DIGITS`` digits: every integer that comes from outside (flags,
    environment, query parameters, headers, file names) is read here.
    """
    if isinstance(text, bytes):
        text = text.decode("ascii", errors="replace")
    digits = text[1:] if signed and text.startswith("-") else text
    if not digits or len(digits) > MAX_DIGITS or not all(c in _DIGITS for c in digits):
        raise ValueError(f"{text[:40]!r} is not an integer in ASCII digits")
    return int(text)


def _decimal(text: str) -> float:
    """A finite float from ASCII text (``float`` alone also takes other scripts' digits, ``nan`` and ``inf``)."""
    if not text.isascii():
        raise ValueError(f"{text!r} is not ASCII")
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is not a finite number")
    return value


def number(kind: Callable[[str], Any], *, zero_ok: bool = False) -> Callable[[str], Any]:
    def signed(text: str) -> int:
        return integer(text, signed=True)

    read: Callable[[str], Any] = signed if kind is int else _decimal if kind is float else kind

    def parse(text: str) -> Any:
        try:
            value = read(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if value < 0 or (value == 0 and not zero_ok):
            raise argparse.ArgumentTypeError(f"{text!r} must be {'>= 0' if zero_ok else '> 0'}")
        return value

    parse.__name__ = kind.__name__
    return parse


def switch(text: str) -> bool:
    word = text.strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not one of 1, true, yes, on, 0, false, no, off")


def url(text: str) -> str:
    url = urlsplit(text)
    try:
        port_ok = url.port is None or url.port > 0
    except ValueError:
        port_ok = False
    if url.scheme not in ("http", "https") or not url.hostname or not port_ok:
        raise errors.ConfigError(
            f"--server {text!r} is not an http(s) URL with a valid port, such as http://127.0.0.1:8080"
        )
    return text


def listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    try:
        number = integer(port) if sep else -1
    except ValueError:
        number = -1
    if not 0 <= number <= 65535:
        raise errors.ConfigError(f"--listen {text!r} is not HOST:PORT (for example 127.0.0.1:9464)")
    # An empty host (":9464") means every interface, as the user asked.
    return host.strip("[]") or "0.0.0.0", number  # noqa: S104


def proxy_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT``, where HOST may be a comma-separated list (``127.0.0.1,[::1]:8080``), as llama-server's
    ``--host`` takes: the proxy listens on each; the hosts come back joined by commas, without brackets."""
    try:
        hosts, sep, port = text.rpartition(":")
        if "," not in hosts:
            return listen(text)
        listed = [h.strip().strip("[]") for h in hosts.split(",")]
        if not sep or not all(listed):
            raise errors.ConfigError(text)
        return ",".join(listed), listen(f"{listed[0]}:{port}")[1]
    except errors.ConfigError:
        raise errors.ConfigError(
            f"--proxy-listen {text!r} is not HOST:PORT (for example 127.0.0.1:8081, or 127.0.0.1,[::1]:8081)"
        ) from None


def agent_listen(text: str) -> tuple[str, int]:
    try:
        return listen(text)
    except errors.ConfigError:
        raise errors.ConfigError(f"--agent-check-listen {text!r} is not HOST:PORT (for example 0.0.0.0:9465)") from None


def first_key(text: str) -> tuple[str | None, apikeys.Keys | None]:
    """The key list as llama-server reads ``--api-key`` (comma-separated, CSV quoting): the first key, to send,
    and all of them, for the proxy to check clients' keys against."""
    try:
        found = next(csv.reader([text]), [])
    except csv.Error as exc:
        raise errors.ConfigError(f"--api-key: the key list is not one line of comma-separated keys: {exc}") from exc
    listed = apikeys.of_list(found)
    return (listed.first if listed is not None else None), listed


def _read_secret(flag: str, path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise errors.ConfigError(f"{flag} {path}: cannot read the file: {exc}") from exc


def key_file(path: str) -> tuple[str, apikeys.Keys]:
    """The keys of a file as llama-server reads ``--api-key-file`` (one per line, ``#`` comments): the first,
    to send, and all of them with their pools (``# pool: NAME`` lines, see :mod:`sidecar.core.apikeys`)."""
    found = apikeys.of_file(_read_secret("--api-key-file", path).splitlines())
    if found is None or found.first is None:
        raise errors.ConfigError(f"--api-key-file {path}: the file holds no key (one key per line, # for comments)")
    return found.first, found


ADMIN_TOKEN_MIN = 16
"""Fewest characters of an admin token: 16 random characters cannot be guessed over HTTP, even unthrottled."""


def admin_token(text: str) -> str | None:
    """``--admin-token``: the token (None for an empty one: no admin endpoints); see :func:`checked_token`."""
    return checked_token(text, given="--admin-token (LLAMA_SIDECAR_ADMIN_TOKEN)") if text else None


def checked_token(text: str, *, given: str) -> str:
    """The admin token, refused if short or padded (``given`` names where it came from).

    A token that starts or ends with whitespace is never matched: callers send it in a header, and HTTP
    strips the spaces around a header's value. A short one can be guessed.
    """
    if text != text.strip():
        raise errors.ConfigError(
            f"{given}: the admin token starts or ends with whitespace (a space, a tab or a line break), which an "
            "'Authorization: Bearer' header cannot carry, so no caller could ever send it: remove the whitespace"
        )
    if len(text) < ADMIN_TOKEN_MIN:
        raise errors.ConfigError(
            f"{given}: the admin token has {len(text)} characters, fewer than the {ADMIN_TOKEN_MIN} required, "
            "because a short token can be guessed: use a random one, for example the output of "
            "'openssl rand -hex 32'"
        )
    return text


def token_file(path: str) -> str:
    token = _read_secret("--admin-token-file", path).removesuffix("\n").removesuffix("\r")
    if not token:
        raise errors.ConfigError(f"--admin-token-file {path}: the file is empty")
    return checked_token(token, given=f"--admin-token-file {path}")
