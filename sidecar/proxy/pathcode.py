"""A request path decoded exactly as llama-server decodes it, and encoded back so it decodes the same (pure).

Invariants and trade-offs: docs/modules.md, `sidecar/proxy/pathcode.py`.
"""

from __future__ import annotations

_HEX = frozenset(b"0123456789abcdefABCDEF")
PLAIN = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~/!$&'()*+,;=:@")
"""Bytes a decoded path may hold: RFC 3986 ``pchar`` without escapes. Every route of llama-server is made of them."""


def _hex(data: bytes, at: int, count: int) -> int | None:
    digits = data[at : at + count]
    if len(digits) != count or not all(b in _HEX for b in digits):
        return None
    return int(digits, 16)


def _utf8(code: int) -> bytes:
    """cpp-httplib's ``to_utf8`` for a code point below 0x10000: nothing for a surrogate."""
    if 0xD800 <= code < 0xE000:
        return b""
    return chr(code).encode("utf-8")


def decode(raw: bytes) -> bytes:
    out = bytearray()
    i = 0
    while i < len(raw):
        byte = raw[i]
        if byte == 0x25 and i + 1 < len(raw):  # '%'
            if raw[i + 1] == 0x75:  # 'u'
                code = _hex(raw, i + 2, 4)
                if code is not None:
                    out += _utf8(code)
                    i += 6
                    continue
            else:
                code = _hex(raw, i + 1, 2)
                if code is not None:
                    out.append(code)
                    i += 3
                    continue
        out.append(byte)
        i += 1
    return bytes(out)


def encode(path: bytes) -> str:
    return "".join(chr(b) if b in PLAIN else f"%{b:02X}" for b in path)


def is_request_target(target: str) -> bool:
    """Only visible ASCII (cpp-httplib also takes bytes >= 0x80 raw; the proxy does not)."""
    return all("!" <= c <= "~" for c in target)


def is_plain(path: bytes) -> bool:
    """Whether a decoded path is one a route can match: ``PLAIN`` bytes, no dot segments, not ``//`` first."""
    if not path.startswith(b"/") or path.startswith(b"//") or not all(b in PLAIN for b in path):
        return False
    return not any(segment in (b".", b"..") for segment in path.split(b"/"))
