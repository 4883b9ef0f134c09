"""The manifest: what a snapshot file holds and which server it fits. Pure code.

A manifest is the commit marker of a snapshot: the ``.bin`` file is only a
snapshot once its ``.json`` manifest exists (see ``store``). It records the
slot, the token count, the byte size, the sha256 of the file, and the
fingerprint of the server that wrote it, so the restorer can refuse files
that would not fit the running server and say which field differs.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from sidecar import events

FORMAT = 1
NAME_RE = re.compile(r"^slot(?P<slot>\d{1,4})-(?P<stamp>\d{8}T\d{12}Z)\.bin$")
"""Final snapshot names: ``slot<id>-<UTC yyyymmddThhmmssffffff>Z.bin``."""


@dataclasses.dataclass(frozen=True, slots=True)
class Fingerprint:
    build_info: str
    model_path: str
    model_size: int | None
    model_params: int | None
    n_ctx: int
    total_slots: int

    @classmethod
    def of(cls, identity: events.Identity, *, n_ctx: int) -> Fingerprint:
        return cls(
            build_info=identity.build_info,
            model_path=identity.model_path,
            model_size=identity.model_size,
            model_params=identity.model_params,
            n_ctx=n_ctx,
            total_slots=identity.total_slots,
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Manifest:
    slot: int
    file: str
    tokens: int
    bytes: int
    sha256: str
    created: float
    """Unix time the snapshot was committed."""
    task: int | None
    """``id_task`` of the slot when saved, to recognise unchanged slots after a sidecar restart."""
    fingerprint: Fingerprint

    def to_json(self) -> str:
        body = dataclasses.asdict(self)
        body["format"] = FORMAT
        return json.dumps(body, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """Parse a manifest; raise ValueError naming the first bad field."""
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("manifest is not a JSON object")
        if raw.get("format") != FORMAT:
            raise ValueError(f"manifest format {raw.get('format')!r} is not {FORMAT}")
        fp = _obj(raw, "fingerprint")
        manifest = cls(
            slot=_int(raw, "slot"),
            file=_str(raw, "file"),
            tokens=_int(raw, "tokens"),
            bytes=_int(raw, "bytes"),
            sha256=_str(raw, "sha256"),
            created=_num(raw, "created"),
            task=_opt_int(raw, "task"),
            fingerprint=Fingerprint(
                build_info=_str(fp, "build_info"),
                model_path=_str(fp, "model_path"),
                model_size=_opt_int(fp, "model_size"),
                model_params=_opt_int(fp, "model_params"),
                n_ctx=_int(fp, "n_ctx"),
                total_slots=_int(fp, "total_slots"),
            ),
        )
        match = NAME_RE.match(manifest.file)
        if match is None or int(match["slot"]) != manifest.slot:
            raise ValueError(f"manifest names file {manifest.file!r}, not a snapshot of slot {manifest.slot}")
        if not re.fullmatch(r"[0-9a-f]{64}", manifest.sha256):
            raise ValueError("manifest sha256 is not 64 hex digits")
        return manifest


def incompatibilities(manifest: Manifest, identity: events.Identity, *, slot_n_ctx: int) -> list[str]:
    """Why ``manifest`` cannot be restored into a server of ``identity``; empty if it can.

    Each entry names the field, the snapshot's value and the server's value.
    """
    fp = manifest.fingerprint
    problems: list[str] = []
    for name, ours, theirs in (
        ("build_info", fp.build_info, identity.build_info),
        ("model_path", fp.model_path, identity.model_path),
        ("model_size", fp.model_size, identity.model_size),
        ("model_params", fp.model_params, identity.model_params),
    ):
        if ours is not None and theirs is not None and ours != theirs:
            problems.append(f"{name}: snapshot {ours!r}, server {theirs!r}")
    if fp.total_slots != identity.total_slots:
        problems.append(
            f"total_slots: snapshot {fp.total_slots}, server {identity.total_slots} "
            "(llama-server refuses KV state saved with another number of slots)"
        )
    elif manifest.slot >= identity.total_slots:
        problems.append(f"total_slots: snapshot is of slot {manifest.slot}, server has {identity.total_slots}")
    if manifest.tokens > slot_n_ctx:
        problems.append(f"n_ctx: snapshot holds {manifest.tokens} tokens, slot context is {slot_n_ctx}")
    return problems


def _get(raw: dict[str, Any], key: str) -> Any:
    if key not in raw:
        raise ValueError(f"manifest lacks {key!r}")
    return raw[key]


def _obj(raw: dict[str, Any], key: str) -> dict[str, Any]:
    value = _get(raw, key)
    if not isinstance(value, dict):
        raise ValueError(f"manifest field {key!r} is not an object")
    return value


def _str(raw: dict[str, Any], key: str) -> str:
    value = _get(raw, key)
    if not isinstance(value, str):
        raise ValueError(f"manifest field {key!r} is not a string")
    return value


def _int(raw: dict[str, Any], key: str) -> int:
    value = _get(raw, key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"manifest field {key!r} is not a non-negative integer")
    return value


def _opt_int(raw: dict[str, Any], key: str) -> int | None:
    return None if raw.get(key) is None else _int(raw, key)


def _num(raw: dict[str, Any], key: str) -> float:
    value = _get(raw, key)
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ValueError(f"manifest field {key!r} is not a number")
    return float(value)
