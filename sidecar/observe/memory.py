"""What kind of memory the served model keeps, read from its GGUF header.

Invariants and trade-offs: docs/modules.md, `sidecar/observe/memory.py`.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import structlog

from sidecar.core import events, gguf
from sidecar.observe import serverargs

log = structlog.get_logger("sidecar.memory")

Kind = events.Memory


RECURRENT = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})
HYBRID = frozenset(
    {
        "jamba",
        "falcon-h1",
        "plamo2",
        "granitehybrid",
        "lfm2",
        "lfm2moe",
        "nemotron_h",
        "nemotron_h_moe",
        "qwen3next",
        "kimi-linear",
        "bailingmoe3",
        "kimi-k3",
        "glm5-next",
        "qwen35",
        "qwen35moe",
        "qwen4exp",
        "deepseek4",
        "minimax-01",
    }
)


CHUNKED = {"llama4": 8192}
"""Architectures whose windowed layers attend in chunks (``LLAMA_SWA_TYPE_CHUNKED``), and the chunk the pinned
build uses whatever the header says (``src/models/llama4.cpp``); a ``sliding_window`` of 0 turns them off."""


@dataclasses.dataclass(frozen=True, slots=True)
class Window:
    """The windowed layers' reach, as llama-server will use it."""

    size: int
    shape: events.WindowShape


def window_of(architecture: str | None, sliding_window: int | None) -> Window | None:
    """The window of a model of ``architecture`` whose header says ``sliding_window`` (None: no key). Pure."""
    if architecture is None or architecture in RECURRENT or architecture in HYBRID:
        return None
    if architecture in CHUNKED:
        if sliding_window == 0:
            return None
        return Window(CHUNKED[architecture], events.WindowShape.CHUNKED)
    if sliding_window is not None and sliding_window > 0:
        return Window(sliding_window, events.WindowShape.STANDARD)
    return None


def classify(architecture: str | None, *, sliding_window: int | None = 0) -> Kind:
    """The memory kind of a model of ``architecture`` (None: unknown). Pure."""
    if architecture is None:
        return Kind.UNKNOWN
    if architecture in RECURRENT:
        return Kind.RECURRENT
    if architecture in HYBRID:
        return Kind.HYBRID
    if window_of(architecture, sliding_window) is not None:
        return Kind.SWA
    return Kind.ATTENTION


def cuts_back(kind: Kind | None) -> bool:
    """Whether a restored state serves a request that agrees with only part of it.

    Not a windowed one: after a restore llama-server reuses it only for a prompt that extends all of
    it (see ``sidecar.snapshots.windowcell``), with or without ``--swa-full`` for any cut deeper than
    the window, so its snapshots are matched by exact prefix as a recurrent state's.
    """
    return kind not in (Kind.RECURRENT, Kind.HYBRID, Kind.SWA)


def with_server(kind: Kind, swa_full: bool | None) -> Kind:
    """The kind of a model served with (True), without (False) or maybe without (None) ``--swa-full``. Pure."""
    return Kind.SWA_FULL if kind is Kind.SWA and swa_full else kind


def of_server(model_path: str, url: str) -> Kind:
    """:func:`of_file`, and for a sliding-window model whether the server at ``url`` runs with ``--swa-full``
    (from its command line when it runs on this host: no reply says it). Blocking: run it in a thread."""
    kind = of_file(model_path)
    if kind is not Kind.SWA:
        return kind
    full = serverargs.swa_full_at(url)
    said = (url, full)
    if said not in _said_full:
        _said_full.add(said)
        log.info(
            "model_window",
            swa_full=full,
            effect="--swa-full: handled as an attention-only model (restores still verified)"
            if full
            else "slots are saved at their prompt's boundary with a cell below the window, so that a restore is "
            "reused by the conversation's next turn; snapshots are matched by exact prefix",
            **({"reason": "no llama-server on this host listens on the upstream's port"} if full is None else {}),
        )
    return with_server(kind, full)


_said_full: set[tuple[str, bool | None]] = set()


def read(path: Path) -> Kind:
    """The memory kind of the model file at ``path``; raises OSError or ValueError if it is not readable GGUF."""
    return read_model(path)[0]


def read_model(path: Path) -> tuple[Kind, Window | None]:
    """The memory kind and window of the model file at ``path``; raises OSError or ValueError if it is not
    readable GGUF.

    Only a regular file is read (a FIFO's open would never return): anything else is a ValueError.
    """
    found = gguf.read_keys(path)
    architecture = found.get("general.architecture")
    if not isinstance(architecture, str):
        architecture = None
    value = found.get(f"{architecture}.attention.sliding_window") if architecture is not None else None
    window = int(value) if isinstance(value, int | float) else None
    return classify(architecture, sliding_window=window), window_of(architecture, window)


_said: set[str] = set()


def of_file(model_path: str) -> Kind:
    """:func:`read` for the model llama-server reports; ``unknown`` (said once per path) if unreadable.

    Read once per file: a header of a large vocabulary takes a quarter of a second to walk, and a restarted
    server's restore round waits for it. The file is known by its device, inode, size and times, as
    ``weights`` keys its checksums; a file changed in place or replaced is read again.
    """
    try:
        key = _file_key(model_path)
        if (known := _read.get(model_path)) is not None and known[0] == key:
            return known[1]
        kind, window = read_model(Path(model_path))
    except (OSError, ValueError) as exc:
        if model_path not in _said:
            _said.add(model_path)
            log.warning(
                "model_memory_unknown",
                model_path=model_path,
                error=f"{type(exc).__name__}: {exc}",
                effect="the model is handled as attention-only: on a hybrid, recurrent or sliding-window model "
                "(Qwen3.5, LFM2, Mamba, Gemma 3, gpt-oss, Llama 4, ...) snapshots then end after the reply and "
                "restores may not be reused (the next request's reuse is still checked: nothing wrong is restored)",
                hint="let the sidecar read the model file at the path llama-server reports (mount the model "
                "directory read-only into the sidecar at the same path)",
            )
        return Kind.UNKNOWN
    _read.pop(model_path, None)
    _read[model_path] = (key, kind, window)
    while len(_read) > _READ_KEEP:
        _read.pop(next(iter(_read)))
    if model_path not in _said:
        _said.add(model_path)
        log.info(
            "model_memory",
            model_path=model_path,
            memory=kind.value,
            cuts_back=cuts_back(kind),
            window=window.size if window is not None else None,
            window_shape=window.shape.value if window is not None else None,
        )
    return kind


_READ_KEEP = 16
_read: dict[str, tuple[tuple[int, ...], Kind, Window | None]] = {}
"""Kinds read by :func:`of_file`, by path: the file's key when read, its kind and window (oldest first)."""


def window_of_file(model_path: str) -> Window | None:
    """The window of the model file at ``model_path`` as :func:`of_file` read it (None: none, or unreadable)."""
    if of_file(model_path) is not Kind.SWA:
        return None
    known = _read.get(model_path)
    return known[2] if known is not None else None


def _file_key(model_path: str) -> tuple[int, ...]:
    st = os.stat(model_path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
