"""The manifest: what a snapshot file holds and which server it fits. Pure code.

Invariants and trade-offs: docs/modules.md, `sidecar/snapshots/manifest.py`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Iterable
from typing import Any

from sidecar.core import apikeys, events, hashing

FORMAT = 2
"""Format of the manifests this sidecar writes."""
READABLE = (1, 2)
MAX_BYTES = 1 << 20
"""Largest manifest (local, or a shared manifest object) the sidecar reads; a larger one is refused unread.

A manifest without an index is under 1 KB; the index adds about 40 bytes per
block of ``slotfile.BLOCK_TOKENS`` tokens (a shared manifest carries the chain
twice, compact): a 1M-token snapshot's shared manifest is about 600 KB."""
MAX_INT = 2**53 - 1
"""Largest integer a manifest may hold: the largest every JSON reader (a browser, ``jq``) reads exactly. A
larger one (``2**63``) is damage, as are NaN and Infinity, which are no JSON at all."""
MAX_TIME = 253_402_300_799.0
"""Latest ``created`` a manifest may hold (9999-12-31T23:59:59Z): the last second a date can show."""
NAME_RE = re.compile(r"(?a)^(?:(?P<tag>[A-Za-z0-9_.-]{1,80})--)?slot(?P<slot>\d{1,4})-(?P<stamp>\d{8}T\d{12}Z)\.bin$")
"""Final snapshot names: ``slot<id>-<UTC yyyymmddThhmmssffffff>Z.bin``, behind ``<model tag>--`` in router mode."""


class NewerFormatError(Exception):
    """The manifest is of a format this sidecar does not know: a newer sidecar wrote it."""

    def __init__(self, found: int) -> None:
        super().__init__(f"manifest format {found} is newer than this sidecar's {FORMAT}")
        self.found = found


@dataclasses.dataclass(frozen=True, slots=True)
class Checksum:
    algorithm: hashing.Algorithm
    digest: str
    """Lower-case hex."""


@dataclasses.dataclass(frozen=True, slots=True)
class Fingerprint:
    build_info: str
    model_path: str
    model_size: int | None
    model_params: int | None
    n_ctx: int
    total_slots: int
    weights: str | None = None
    """Checksum of the model file, ``<algorithm>:<hex>``; None when it was not readable."""
    adapters: tuple[events.Adapter, ...] | None = None
    """LoRA adapters and scales; None when unknown."""
    memory: str | None = None
    """The model's memory kind (``events.Memory``) when saved; None when unknown. Shown, not compared."""

    @classmethod
    def of(cls, identity: events.Identity, *, n_ctx: int) -> Fingerprint:
        return cls(
            build_info=identity.build_info,
            model_path=identity.model_path,
            model_size=identity.model_size,
            model_params=identity.model_params,
            n_ctx=n_ctx,
            total_slots=identity.total_slots,
            weights=identity.weights,
            adapters=identity.adapters,
            memory=identity.memory.value if identity.memory is not None else None,
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Index:
    """What a snapshot holds, by content: read from the slot file's token header at commit.

    Only hashes are kept: ``chain[i]`` covers the first ``(i + 1) * block``
    token ids (see ``slotfile.prefix_hashes``); the ids themselves never leave
    the slot file.
    """

    tokens: int
    block: int
    chain: tuple[str, ...]
    whole: str | None = None
    """``slotfile.whole_hash`` of every token id, the partial last block included (None in older manifests):
    on a model that cannot cut a state back, a snapshot serves a request only when this matches."""

    @property
    def key(self) -> str:
        """A short name for the conversation: the start of the chain's last hash ("" with no full block)."""
        return self.chain[-1][:12] if self.chain else ""


@dataclasses.dataclass(frozen=True, slots=True)
class Manifest:
    slot: int
    file: str
    tokens: int
    bytes: int
    checksum: Checksum
    generation: int
    """Position in the directory's history: 1 + the highest generation present when committed.
    Orders snapshots whatever the wall clock did; format-1 manifests read as 0."""
    created: float
    """Unix time the snapshot was committed (for display and --max-age, never for ordering)."""
    task: int | None
    """``id_task`` of the slot when saved, to recognise unchanged slots after a sidecar restart."""
    fingerprint: Fingerprint
    index: Index | None = None
    """The snapshot's content index; None when the slot file could not be parsed (restorable by slot only)."""
    model: str | None = None
    """The model's name in llama-server's router mode (its files start with :func:`model_tag`); None otherwise."""
    prefill_rate: float | None = None
    """Prompt tokens per second the writing server computed over its lifetime when the snapshot was saved
    (``llamacpp:prompt_tokens_total`` over ``prompt_seconds_total``), so another node, or this one after a
    restart, knows what recomputing these tokens costs on this model; None if it had not prefilled enough."""
    owner: str = apikeys.NOBODY
    """Whose conversation it is (``apikeys.owner_of``: the fingerprint of the API key or pool whose request left
    the slot so; ``apikeys.NOBODY`` without keys, for content no routed request explains, and in older manifests):
    the library serves it only to requests of the same owner."""

    recipe: str | None = None
    """The block store's recipe that holds the file's bytes (``--store-dir``, see ``backing``); None: the
    ``.bin`` file beside the manifest holds them."""

    def to_json(self) -> str:
        body = dataclasses.asdict(self)
        if self.recipe is None:
            del body["recipe"]  # a whole-file manifest reads as before to an older sidecar
        body["format"] = FORMAT
        return json.dumps(body, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """Parse a manifest of any readable format.

        Raise ValueError naming the first bad field (the content is damaged),
        or NewerFormatError for a format newer than this sidecar's.
        """
        raw = json.loads(text, parse_constant=_no_constant)
        if not isinstance(raw, dict):
            raise ValueError("manifest is not a JSON object")
        fmt = raw.get("format")
        if not isinstance(fmt, int) or isinstance(fmt, bool) or fmt < 1:
            raise ValueError(f"manifest format {fmt!r} is not a format number")
        if fmt > FORMAT:
            raise NewerFormatError(fmt)
        fp = _obj(raw, "fingerprint")
        if fmt == 1:
            checksum, generation = Checksum(hashing.Algorithm.SHA256, _str(raw, "sha256")), 0
        else:
            checksum, generation = _checksum(_obj(raw, "checksum")), _int(raw, "generation")
        manifest = cls(
            slot=_int(raw, "slot"),
            file=_str(raw, "file"),
            tokens=_int(raw, "tokens"),
            bytes=_int(raw, "bytes"),
            checksum=checksum,
            generation=generation,
            created=_num(raw, "created", low=0.0, high=MAX_TIME),
            task=_opt_int(raw, "task"),
            fingerprint=Fingerprint(
                build_info=_str(fp, "build_info"),
                model_path=_str(fp, "model_path"),
                model_size=_opt_int(fp, "model_size"),
                model_params=_opt_int(fp, "model_params"),
                n_ctx=_int(fp, "n_ctx"),
                total_slots=_int(fp, "total_slots"),
                weights=None if fp.get("weights") is None else _str(fp, "weights"),
                adapters=_adapters(fp),
                memory=None if fp.get("memory") is None else _str(fp, "memory"),
            ),
            index=_index(raw),
            model=None if raw.get("model") is None else _str(raw, "model"),
            prefill_rate=None if raw.get("prefill_rate") is None else _num(raw, "prefill_rate", low=0.0),
            owner=apikeys.NOBODY if raw.get("owner") is None else _str(raw, "owner"),
            recipe=None if raw.get("recipe") is None else _str(raw, "recipe"),
        )
        match = NAME_RE.match(manifest.file)
        if match is None or int(match["slot"]) != manifest.slot:
            raise ValueError(f"manifest names file {manifest.file!r}, not a snapshot of slot {manifest.slot}")
        if match["tag"] != (None if manifest.model is None else model_tag(manifest.model)):
            raise ValueError(f"manifest names file {manifest.file!r}, not a file of model {manifest.model!r}")
        digits = hashing.DIGEST_HEX[checksum.algorithm]
        if not re.fullmatch(f"[0-9a-f]{{{digits}}}", checksum.digest):
            name = "sha256" if fmt == 1 else "checksum digest"
            raise ValueError(f"manifest {name} is not {digits} lower-case hex digits")
        return manifest


def model_tag(model: str) -> str:
    """The file-name prefix of a router-mode model: its name made safe for a flat file name, and a hash.

    llama-server takes bare file names (no ``/`` or ``:``) of at most 255
    characters; model names may hold both. The hash keeps two names that
    differ only in replaced characters apart.
    """
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", model).strip("._-")[:60] or "model"
    return f"{safe}-{hashlib.sha256(model.encode()).hexdigest()[:8]}"


def newest_first(manifests: Iterable[Manifest]) -> list[Manifest]:
    """Order by generation (then by time and name, among format-1 snapshots of generation 0)."""
    return sorted(manifests, key=lambda m: (m.generation, m.created, m.file), reverse=True)


def incompatibilities(manifest: Manifest, identity: events.Identity, *, slot_n_ctx: int) -> list[str]:
    """Why ``manifest`` cannot be restored into a server of ``identity``; empty if it can.

    Each entry names the field, the snapshot's value and the server's value.
    A field one side does not know (None) is not a difference: the older
    fields still decide, as they did before the field existed.
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
    if fp.weights is not None and identity.weights is not None and fp.weights != identity.weights:
        problems.append(
            f"weights: snapshot {fp.weights}, server {identity.weights} "
            "(the model file has other content: KV computed with other weights would change answers)"
        )
    if fp.adapters is not None and identity.adapters is not None and fp.adapters != identity.adapters:
        problems.append(f"adapters: snapshot {_show(fp.adapters)}, server {_show(identity.adapters)}")
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


def _show(adapters: tuple[events.Adapter, ...]) -> str:
    return "[" + ", ".join(f"{a.id}:{a.path}@{a.scale:g}" for a in adapters) + "]" if adapters else "none"


def _checksum(raw: dict[str, Any]) -> Checksum:
    name = _str(raw, "algorithm")
    try:
        algorithm = hashing.Algorithm(name)
    except ValueError:
        raise ValueError(
            f"manifest checksum algorithm {name!r} is not one of {[a.value for a in hashing.Algorithm]}"
        ) from None
    return Checksum(algorithm, _str(raw, "digest"))


def _index(raw: dict[str, Any]) -> Index | None:
    value = raw.get("index")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("manifest field 'index' is not an object")
    chain = _get(value, "chain")
    if not isinstance(chain, list) or not all(isinstance(h, str) and _HASH_RE.fullmatch(h) for h in chain):
        raise ValueError("manifest field 'index.chain' is not a list of hex hashes")
    block = _int(value, "block")
    if block == 0:
        raise ValueError("manifest field 'index.block' is 0")
    whole = value.get("whole")
    if whole is not None and not (isinstance(whole, str) and _HASH_RE.fullmatch(whole)):
        raise ValueError("manifest field 'index.whole' is not a hex hash")
    return Index(tokens=_int(value, "tokens"), block=block, chain=tuple(chain), whole=whole)


_HASH_RE = re.compile(r"[0-9a-f]{8,64}")


def _adapters(raw: dict[str, Any]) -> tuple[events.Adapter, ...] | None:
    value = raw.get("adapters")
    if value is None:
        return None
    if not isinstance(value, list):
        raise ValueError("manifest field 'adapters' is not a list")
    found: list[events.Adapter] = []
    for item in value:
        if not isinstance(item, dict):
            raise ValueError("manifest field 'adapters' holds a non-object")
        found.append(events.Adapter(id=_int(item, "id"), path=_str(item, "path"), scale=_num(item, "scale")))
    return tuple(found)


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


def _no_constant(name: str) -> float:
    raise ValueError(f"manifest holds {name}, which is no JSON number")


def _int(raw: dict[str, Any], key: str) -> int:
    value = _get(raw, key)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_INT:
        raise ValueError(f"manifest field {key!r} is not an integer from 0 to 2**53 - 1")
    return value


def _opt_int(raw: dict[str, Any], key: str) -> int | None:
    return None if raw.get(key) is None else _int(raw, key)


def _num(raw: dict[str, Any], key: str, *, low: float = -MAX_INT, high: float = MAX_INT) -> float:
    """A number within ``low`` and ``high``: never NaN, an infinity, or an integer too large for a float."""
    value = _get(raw, key)
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ValueError(f"manifest field {key!r} is not a number")
    if not low <= value <= high:  # False for NaN too; compared before float(), which overflows on 10**400
        raise ValueError(f"manifest field {key!r} is {str(value)[:40]}, not a number from {low:g} to {high:g}")
    return float(value)
