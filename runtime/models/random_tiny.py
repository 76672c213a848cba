"""`random:tiny`: a tiny random-weight Qwen3 that kvc writes to its cache on first use.

It lets tests that only need shapes run in seconds on a machine with no model: a complete Hugging
Face directory (config.json, generation_config.json, model.safetensors, a byte-level tokenizer)
generated from a fixed seed. Every byte is computed by this file with exact arithmetic (integer random
draws scaled by a power of two, JSON with sorted keys, a hand-laid safetensors file), so the
directory is identical on every machine and with every library version.

The weights are random: the model produces fluent-looking nonsense, which is all such a test needs.
The embedded default model, a real trained one, is runtime/default_model.py.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np

from kvc.runtime.models import byte_tokenizer as tok
from kvc.runtime.models.model_cache import build_once, cache_root

VERSION = "v1"
NAME = "tiny"  # random:tiny
DIR_NAME = f"random-tiny-{VERSION}"
SEED = 20240611
# Weights are k / 2**12 for integers k in [-128, 128]: exact in float32, std about 0.018.
WEIGHT_RANGE = 128
WEIGHT_SCALE = 2.0**-12

CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": tok.VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "attention_bias": False,
    "use_sliding_window": False,
    "tie_word_embeddings": False,
    "bos_token_id": None,
    "eos_token_id": tok.token_id(tok.EOS_TOKEN),
    "pad_token_id": tok.token_id(tok.PAD_TOKEN),
    "dtype": "float32",
}

GENERATION_CONFIG: dict[str, Any] = {
    "eos_token_id": [tok.token_id(tok.EOS_TOKEN), tok.token_id(tok.PAD_TOKEN)],
    "pad_token_id": tok.token_id(tok.PAD_TOKEN),
}


def tiny_model_dir(cache_dir: str | Path | None = None) -> Path:
    """Where the tiny model lives: <cache>/random-tiny-v1 (model_cache.cache_root)."""
    return cache_root(cache_dir) / DIR_NAME


def ensure_tiny_model(cache_dir: str | Path | None = None) -> Path:
    """The tiny model's directory, generated on first use (atomically, model_cache.build_once)."""
    return build_once(tiny_model_dir(cache_dir), write_tiny_model)


def write_tiny_model(directory: Path) -> None:
    """Write every file of the tiny model into an existing directory."""
    tok.write_json(directory / "config.json", CONFIG)
    tok.write_json(directory / "generation_config.json", GENERATION_CONFIG)
    tok.write_tokenizer(directory, model_max_length=CONFIG["max_position_embeddings"])
    write_safetensors(directory / "model.safetensors", tiny_weights())


def tiny_weights() -> dict[str, np.ndarray]:
    """Hugging Face Qwen3 tensor names -> float32 arrays; norms are ones."""
    c = CONFIG
    hidden, inter, head_dim = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q_size = c["num_attention_heads"] * head_dim
    kv_size = c["num_key_value_heads"] * head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (c["vocab_size"], hidden),
    }
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.input_layernorm.weight": (hidden,),
            f"{p}.post_attention_layernorm.weight": (hidden,),
            f"{p}.self_attn.q_proj.weight": (q_size, hidden),
            f"{p}.self_attn.k_proj.weight": (kv_size, hidden),
            f"{p}.self_attn.v_proj.weight": (kv_size, hidden),
            f"{p}.self_attn.o_proj.weight": (hidden, q_size),
            f"{p}.self_attn.q_norm.weight": (head_dim,),
            f"{p}.self_attn.k_norm.weight": (head_dim,),
            f"{p}.mlp.gate_proj.weight": (inter, hidden),
            f"{p}.mlp.up_proj.weight": (inter, hidden),
            f"{p}.mlp.down_proj.weight": (hidden, inter),
        }
    # RandomState's integer stream is frozen by NumPy's compatibility policy.
    rng = np.random.RandomState(SEED)
    weights = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("norm.weight"):
            weights[name] = np.ones(shape, dtype=np.float32)
        else:
            ints = rng.randint(-WEIGHT_RANGE, WEIGHT_RANGE + 1, size=shape, dtype=np.int64)
            weights[name] = ints.astype(np.float32) * np.float32(WEIGHT_SCALE)
    return weights


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """float32 tensors in name order behind a sorted, space-padded JSON header (the safetensors
    format: 8-byte little-endian header length, header, raw little-endian data)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in sorted(tensors):
        size = tensors[name].size * 4
        header[name] = {
            "dtype": "F32",
            "shape": list(tensors[name].shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    header_bytes = json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for name in sorted(tensors):
            f.write(tensors[name].astype("<f4").tobytes())
