"""Turning the text of a flag or environment variable into a value.

Numbers with their sign checked, on/off switches, llama-server's URL, the
listen address, API key lists as llama-server reads them, and the files that
hold secrets. Errors argparse can report are ``argparse.ArgumentTypeError``;
the others are ``errors.ConfigError`` with the flag named.
"""

from __future__ import annotations

import argparse
import csv
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from sidecar.core import errors


def number(kind: Callable[[str], Any], *, zero_ok: bool = False) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
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
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise errors.ConfigError(f"--listen {text!r} is not HOST:PORT (for example 127.0.0.1:9464)")
    # An empty host (":9464") means every interface, as the user asked.
    return host.strip("[]") or "0.0.0.0", int(port)  # noqa: S104


def proxy_listen(text: str) -> tuple[str, int]:
    try:
        return listen(text)
    except errors.ConfigError:
        raise errors.ConfigError(f"--proxy-listen {text!r} is not HOST:PORT (for example 127.0.0.1:8081)") from None


def first_key(text: str) -> str | None:
    """The first key of a list as llama-server reads ``--api-key``: comma-separated, CSV quoting."""
    try:
        keys = next(csv.reader([text]), [])
    except csv.Error as exc:
        raise errors.ConfigError(f"--api-key: the key list is not one line of comma-separated keys: {exc}") from exc
    return next((key for key in keys if key), None)


def _read_secret(flag: str, path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise errors.ConfigError(f"{flag} {path}: cannot read the file: {exc}") from exc


def key_file(path: str) -> str:
    """The first key of a file as llama-server reads ``--api-key-file``: one per line, ``#`` comments."""
    lines = _read_secret("--api-key-file", path).splitlines()
    key = next((line for line in lines if line and not line.startswith("#")), None)
    if key is None:
        raise errors.ConfigError(f"--api-key-file {path}: the file holds no key (one key per line, # for comments)")
    return key


def token_file(path: str) -> str:
    token = _read_secret("--admin-token-file", path).removesuffix("\n").removesuffix("\r")
    if not token:
        raise errors.ConfigError(f"--admin-token-file {path}: the file is empty")
    return token
