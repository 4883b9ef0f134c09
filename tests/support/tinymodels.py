"""Tiny random-weight GGUFs of hybrid architectures, written by the test bed: no download.

No small hybrid model is on the package registries, yet the state mechanics
the sidecar must get right (a recurrent state that can be extended but not
cut back, context checkpoints in RAM only) are those of llama-server itself,
whatever the weights. So the bed writes a model file of each architecture
with the `gguf` package: the keys and tensor shapes of the pinned source's
`src/models/qwen35.cpp` (Gated DeltaNet layers, every fourth layer attends)
and `src/models/lfm2.cpp` (short convolutions, some layers attend), random
weights, the tokenizer of the test model (Gemma 3's SPM vocabulary, copied
key by key) and a small ChatML chat template. The text they generate is
gibberish; the KV and recurrent state are real.

A ggml tensor `{ne0, ne1}` is a numpy array of shape `(ne1, ne0)`. A file
is about 40 MB (the 262,144-token embedding in f16) and takes about 40 s to
write (copying the vocabulary), so `model(arch)` keeps it in the user cache
dir under a name that changes with this module's source: written once per
machine and per change of the maker.
"""

from __future__ import annotations

import enum
import hashlib
import os
import threading
from pathlib import Path
from typing import Any

import gguf
import numpy as np

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""A ChatML template: the test model's file has none, and chat turns need one."""


class Arch(enum.StrEnum):
    QWEN35 = "qwen35"
    """Gated DeltaNet (recurrent) layers with a full-attention layer every fourth (Qwen3.5/3.6)."""
    LFM2 = "lfm2"
    """Short-convolution (recurrent) layers with a few attention layers (LFM2)."""


class Windowed(enum.StrEnum):
    GPT_OSS = "gpt-oss"
    """Every other layer attends to a window of :data:`WINDOW` positions, with attention sinks and a mixture of
    experts (gpt-oss, ``src/models/openai-moe.cpp``)."""


WINDOW = 128
"""gpt-oss's window (both sizes)."""
N_EXPERT = 4


def windowed(arch: Windowed, *, tokenizer_from: Path, root: Path | None = None) -> Path:
    """The path of a tiny sliding-window ``arch`` model, written on first use (as :func:`model`)."""
    return model(arch, tokenizer_from=tokenizer_from, root=root)


DENSE = "gemma3"
"""The test bed's own model (attention only), beside the tiny hybrids in a parametrized test."""


def serving(kind: str, models: dict[Arch, Path]) -> dict[str, Any]:
    """The ``llama(...)`` keywords that serve ``kind``: :data:`DENSE` (the bed's model) or an :class:`Arch`
    from ``models`` (the ``tiny_models`` fixture), without ``--swa-full``, which a hybrid does not use."""
    return {} if kind == DENSE else {"model": models[Arch(kind)], "swa_full": False}


N_EMBD = 64
N_HEAD = 4
HEAD = 16
N_HEAD_KV = 2
N_LAYER = 4
N_FF = 128
CONTEXT = 32768

_lock = threading.Lock()
_made: dict[tuple[Arch | Windowed, Path], Path] = {}


def cache_dir() -> Path:
    """Where the tiny models are kept: the user cache dir, one folder per version of this module."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    version = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    return root / "llama-kv-sidecar" / f"tiny-models-{version}"


def model(arch: Arch | Windowed, *, tokenizer_from: Path, root: Path | None = None) -> Path:
    """The path of a tiny ``arch`` model (with the tokenizer of ``tokenizer_from``), written on first use."""
    folder = root or cache_dir()
    key = (arch, folder)
    with _lock:
        if key not in _made or not _made[key].exists():
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"tiny-{arch.value}.gguf"
            if not path.exists():
                temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
                write(arch, temp, tokenizer_from=tokenizer_from)
                temp.replace(path)
            _made[key] = path
        return _made[key]


def write(arch: Arch | Windowed, path: Path, *, tokenizer_from: Path, seed: int = 0) -> None:
    """Write a tiny ``arch`` model to ``path``."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch.value)
    writer.add_uint32("general.file_type", 1)
    writer.add_string("general.name", f"tiny random {arch.value}")
    a = arch.value
    writer.add_uint32(f"{a}.context_length", CONTEXT)
    writer.add_uint32(f"{a}.embedding_length", N_EMBD)
    writer.add_uint32(f"{a}.block_count", N_LAYER)
    writer.add_uint32(f"{a}.feed_forward_length", N_FF)
    writer.add_uint32(f"{a}.attention.head_count", N_HEAD)
    writer.add_uint32(f"{a}.attention.key_length", HEAD)
    writer.add_uint32(f"{a}.attention.value_length", HEAD)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32(f"{a}.rope.freq_base", 10000.0)
    writer.add_uint32(f"{a}.rope.dimension_count", HEAD)
    vocab = _copy_tokenizer(writer, tokenizer_from)
    writer.add_string("tokenizer.chat_template", CHATML)
    tensors: dict[str, np.ndarray[Any, Any]] = {}

    def weight(name: str, ne0: int, ne1: int) -> None:
        tensors[name] = (rng.standard_normal((ne1, ne0)) * 0.05).astype(np.float16)

    def conv(name: str, ne0: int, ne1: int) -> None:
        tensors[name] = (rng.standard_normal((ne1, ne0)) * 0.05).astype(np.float32)

    def vector(name: str, n: int, value: float | None = None) -> None:
        data = np.full(n, value) if value is not None else rng.standard_normal(n) * 0.05
        tensors[name] = data.astype(np.float32)

    weight("token_embd.weight", N_EMBD, vocab)
    if arch is Windowed.GPT_OSS:
        _gpt_oss(writer, weight, vector, vocab, tensors, rng)
    elif arch is Arch.QWEN35:
        _qwen35(writer, weight, conv, vector)
    else:
        _lfm2(writer, weight, conv, vector)
    for il in range(N_LAYER if arch is not Windowed.GPT_OSS else 0):
        weight(f"blk.{il}.ffn_gate.weight", N_EMBD, N_FF)
        weight(f"blk.{il}.ffn_up.weight", N_EMBD, N_FF)
        weight(f"blk.{il}.ffn_down.weight", N_FF, N_EMBD)
        vector(f"blk.{il}.attn_norm.weight", N_EMBD, 1.0)
    for name, data in tensors.items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _qwen35(writer: gguf.GGUFWriter, weight: Any, conv: Any, vector: Any) -> None:
    a = "qwen35"
    state, groups, rank, kernel, interval = 16, 2, 4, 4, 4
    writer.add_uint32(f"{a}.attention.head_count_kv", N_HEAD_KV)
    writer.add_array(f"{a}.rope.dimension_sections", [4, 2, 2, 0])
    writer.add_uint32(f"{a}.ssm.conv_kernel", kernel)
    writer.add_uint32(f"{a}.ssm.state_size", state)
    writer.add_uint32(f"{a}.ssm.group_count", groups)
    writer.add_uint32(f"{a}.ssm.time_step_rank", rank)
    writer.add_uint32(f"{a}.ssm.inner_size", state * rank)
    writer.add_uint32(f"{a}.full_attention_interval", interval)
    key_dim, value_dim = state * groups, state * rank
    vector("output_norm.weight", N_EMBD, 1.0)
    for il in range(N_LAYER):
        vector(f"blk.{il}.post_attention_norm.weight", N_EMBD, 1.0)
        if (il + 1) % interval == 0:  # attends
            weight(f"blk.{il}.attn_q.weight", N_EMBD, 2 * HEAD * N_HEAD)
            weight(f"blk.{il}.attn_k.weight", N_EMBD, HEAD * N_HEAD_KV)
            weight(f"blk.{il}.attn_v.weight", N_EMBD, HEAD * N_HEAD_KV)
            weight(f"blk.{il}.attn_output.weight", HEAD * N_HEAD, N_EMBD)
            vector(f"blk.{il}.attn_q_norm.weight", HEAD, 1.0)
            vector(f"blk.{il}.attn_k_norm.weight", HEAD, 1.0)
        else:  # Gated DeltaNet
            weight(f"blk.{il}.attn_qkv.weight", N_EMBD, 2 * key_dim + value_dim)
            weight(f"blk.{il}.attn_gate.weight", N_EMBD, value_dim)
            conv(f"blk.{il}.ssm_conv1d.weight", kernel, 2 * key_dim + value_dim)
            vector(f"blk.{il}.ssm_dt.bias", rank)
            vector(f"blk.{il}.ssm_a", rank, -1.0)
            weight(f"blk.{il}.ssm_beta.weight", N_EMBD, rank)
            weight(f"blk.{il}.ssm_alpha.weight", N_EMBD, rank)
            vector(f"blk.{il}.ssm_norm.weight", state, 1.0)
            weight(f"blk.{il}.ssm_out.weight", value_dim, N_EMBD)


def _lfm2(writer: gguf.GGUFWriter, weight: Any, conv: Any, vector: Any) -> None:
    a = "lfm2"
    l_cache = 3
    kv = [0, 0, N_HEAD_KV, 0]
    writer.add_array(f"{a}.attention.head_count_kv", kv)
    writer.add_uint32(f"{a}.shortconv.l_cache", l_cache)
    vector("token_embd_norm.weight", N_EMBD, 1.0)
    for il in range(N_LAYER):
        vector(f"blk.{il}.ffn_norm.weight", N_EMBD, 1.0)
        if kv[il]:
            weight(f"blk.{il}.attn_q.weight", N_EMBD, N_EMBD)
            weight(f"blk.{il}.attn_k.weight", N_EMBD, HEAD * N_HEAD_KV)
            weight(f"blk.{il}.attn_v.weight", N_EMBD, HEAD * N_HEAD_KV)
            weight(f"blk.{il}.attn_output.weight", N_EMBD, N_EMBD)
            vector(f"blk.{il}.attn_q_norm.weight", HEAD, 1.0)
            vector(f"blk.{il}.attn_k_norm.weight", HEAD, 1.0)
        else:
            conv(f"blk.{il}.shortconv.conv.weight", l_cache, N_EMBD)
            weight(f"blk.{il}.shortconv.in_proj.weight", N_EMBD, 3 * N_EMBD)
            weight(f"blk.{il}.shortconv.out_proj.weight", N_EMBD, N_EMBD)


def _gpt_oss(
    writer: gguf.GGUFWriter,
    weight: Any,
    vector: Any,
    vocab: int,
    tensors: dict[str, np.ndarray[Any, Any]],
    rng: np.random.Generator,
) -> None:
    a = "gpt-oss"
    ff = N_FF // 2
    writer.add_uint32(f"{a}.attention.head_count_kv", N_HEAD_KV)
    writer.add_uint32(f"{a}.attention.sliding_window", WINDOW)
    writer.add_uint32(f"{a}.expert_feed_forward_length", ff)
    writer.add_uint32(f"{a}.expert_count", N_EXPERT)
    writer.add_uint32(f"{a}.expert_used_count", 2)
    vector("output_norm.weight", N_EMBD, 1.0)
    weight("output.weight", N_EMBD, vocab)
    for il in range(N_LAYER):
        vector(f"blk.{il}.attn_norm.weight", N_EMBD, 1.0)
        vector(f"blk.{il}.post_attention_norm.weight", N_EMBD, 1.0)
        weight(f"blk.{il}.attn_q.weight", N_EMBD, HEAD * N_HEAD)
        weight(f"blk.{il}.attn_k.weight", N_EMBD, HEAD * N_HEAD_KV)
        weight(f"blk.{il}.attn_v.weight", N_EMBD, HEAD * N_HEAD_KV)
        vector(f"blk.{il}.attn_q.bias", HEAD * N_HEAD)
        vector(f"blk.{il}.attn_k.bias", HEAD * N_HEAD_KV)
        vector(f"blk.{il}.attn_v.bias", HEAD * N_HEAD_KV)
        weight(f"blk.{il}.attn_output.weight", HEAD * N_HEAD, N_EMBD)
        vector(f"blk.{il}.attn_output.bias", N_EMBD)
        vector(f"blk.{il}.attn_sinks.weight", N_HEAD)
        weight(f"blk.{il}.ffn_gate_inp.weight", N_EMBD, N_EXPERT)
        vector(f"blk.{il}.ffn_gate_inp.bias", N_EXPERT)
        for name, ne0, ne1 in (("gate", N_EMBD, ff), ("up", N_EMBD, ff), ("down", ff, N_EMBD)):
            # {ne0, ne1, n_expert}: numpy (n_expert, ne1, ne0); f32, as the CPU backend's MoE wants
            data = rng.standard_normal((N_EXPERT, ne1, ne0)) * 0.05
            tensors[f"blk.{il}.ffn_{name}_exps.weight"] = data.astype(np.float32)
            tensors[f"blk.{il}.ffn_{name}_exps.bias"] = (rng.standard_normal((N_EXPERT, ne1)) * 0.05).astype(np.float32)


def _copy_tokenizer(writer: gguf.GGUFWriter, source: Path) -> int:
    """Copy every ``tokenizer.*`` key of the model at ``source``; return its vocabulary size."""
    reader = gguf.GGUFReader(str(source))
    vocab = 0
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer.") or name == "tokenizer.chat_template":
            continue
        main = field.types[0]
        value = field.contents()
        if main is gguf.GGUFValueType.ARRAY:
            if name == "tokenizer.ggml.tokens":
                vocab = len(value)
            writer.add_key_value(name, value, main, sub_type=field.types[-1])
        else:
            writer.add_key_value(name, value, main)
    if not vocab:
        raise ValueError(f"{source} has no tokenizer.ggml.tokens")
    return vocab
