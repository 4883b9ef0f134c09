"""What a slot file's K and V rows take per token, read from a model's GGUF header, and what two saves share.

A save of the same tokens at the same positions as an earlier save holds
the same K and V bytes, and the block store cuts them in 256-position
ranges (``sidecar.blocks.layout``): what two saves share is every whole
range both hold, at the model's bytes per token. The tests state their
bounds with it instead of a number measured once. The KV cache is f16
(llama-server's default).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from sidecar.blocks import layout
from tests.support import weights

F16 = 2
SWA_PATTERN = {"gemma3": 6}
"""Architectures whose layers slide a window, by the pinned source (``src/models/gemma3.cpp``,
``load_swa_pattern(ml, 6)``): layer ``il`` attends through the window when ``il % 6 < 5``."""


@dataclasses.dataclass(frozen=True)
class Shape:
    full: int
    """K and V bytes per token of the layers that attend to every position."""
    windowed: int
    """Of the layers that attend through a sliding window (saved: only the window's cells)."""
    window: int
    """Positions in the window (0: none)."""

    def shared(self, earlier: int, later: int) -> int:
        """K and V bytes a save of ``later`` tokens holds in whole ranges a save of its first ``earlier`` held."""
        ranges = layout.TOKENS
        full = (earlier // ranges) * ranges * self.full
        if not self.window:
            return full
        # llama.cpp saves a windowed layer's cells from position n - window on (``is_masked_swa``)
        first = -(-max(0, later - self.window) // ranges)
        return full + max(0, earlier // ranges - first) * ranges * self.windowed


def of(model: Path, *, element: int = F16) -> Shape:
    """The shape of ``model``'s KV: a recurrent layer keeps none.

    ``head_count_kv`` is one number or one per layer (LFM2: 0 for a convolution layer);
    a ``full_attention_interval`` (Qwen3.5) makes only every such layer attend.
    """
    keys = ("block_count", "attention.head_count_kv", "full_attention_interval", "attention.key_length",
            "attention.value_length", "attention.sliding_window")  # fmt: skip
    fields = weights.header_values(model, lambda key: key == "general.architecture" or key.endswith(keys))
    arch = str(fields["general.architecture"])

    layers = int(fields[f"{arch}.block_count"])
    heads = fields[f"{arch}.attention.head_count_kv"]
    per_layer = [int(h) for h in heads] if isinstance(heads, list) else [int(heads)] * layers
    interval = int(fields.get(f"{arch}.full_attention_interval", 1))
    row = element * (int(fields[f"{arch}.attention.key_length"]) + int(fields[f"{arch}.attention.value_length"]))
    pattern = SWA_PATTERN.get(arch, 0)
    full = windowed = 0
    for il, h in enumerate(per_layer):
        if (il + 1) % interval:
            continue
        if pattern and il % pattern < pattern - 1:
            windowed += h * row
        else:
            full += h * row
    window = int(fields.get(f"{arch}.attention.sliding_window", 0)) if pattern else 0
    return Shape(full, windowed, window)
