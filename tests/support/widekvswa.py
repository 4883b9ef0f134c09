"""A random-weight sliding-window model with an 8B-class KV shape, written by the test bed: no download.

The windowed sibling of :mod:`tests.support.widekv`: the same attention
(32 layers x 8 KV heads x 128 dims of K and of V, 128 KiB per token in f16
were every layer global, as Llama 3.1 8B and Qwen3 8B), in a ``gemma3``
GGUF with a sliding window of :data:`WINDOW` positions in 5 of every 6
layers, as Gemma 3 4B to 27B keep it (``src/models/gemma3.cpp``: the
pattern is fixed at 6; 32 layers is the size the pinned build names 8B).
Without ``--swa-full`` its slot files hold every position of the 6 global
layers (5 of them in 32: layers 5, 11, 17, 23 and 29) and the last
:data:`WINDOW` positions of the others; what saving one costs the sidecar
beyond a plain model's save (the rewind to the prompt's boundary: a scratch
save, then the server's own rebuild from its checkpoint) follows that.
Its text is gibberish; its KV is real. Kept in the user cache dir under a
name that changes with this module's source, as :mod:`tests.support.widekv`.
"""

from __future__ import annotations

from pathlib import Path

from tests.support import widekv

WINDOW = 1024
"""Gemma 3 4B, 12B and 27B's window."""
PATTERN = 6
"""Every 6th layer is global (``load_swa_pattern(ml, 6)``)."""
GLOBAL_LAYERS = sum(1 for il in range(widekv.N_LAYER) if il % PATTERN == PATTERN - 1)
KV_BYTES_PER_TOKEN = widekv.KV_BYTES_PER_TOKEN
"""K and V of every layer, f16: 131,072 bytes (what ``--swa-full`` would keep per token)."""
GLOBAL_KV_BYTES_PER_TOKEN = GLOBAL_LAYERS * widekv.N_HEAD_KV * widekv.HEAD * 2 * 2
"""What a slot file holds per token beyond the window: the global layers' K and V."""


def model(*, tokenizer_from: Path) -> Path:
    """The path of the model, written on first use (about a minute: the vocabulary and ~230 MB)."""
    return widekv.cached(
        "wide-kv-swa",
        "gemma3-8b-class-kv-swa.gguf",
        (Path(__file__), Path(widekv.__file__)),
        lambda path: widekv.write(
            path,
            tokenizer_from,
            arch="gemma3",
            name="random gemma3 with an 8B-class KV and a sliding window",
            u32=(("attention.sliding_window", WINDOW),),
            f32=(("rope.freq_base_swa", 10000.0),),
            norms=("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"),
        ),
    )
