"""The embedded default model: a tiny Qwen3 that kvc writes to its cache on first use.

It lets `kvc` run (and be tested) on a machine with no model downloaded: a complete Hugging Face
directory (config.json, generation_config.json, model.safetensors, tokenizer files) generated
from a fixed seed. Every byte is computed by this file with exact arithmetic (integer random
draws scaled by a power of two, JSON with sorted keys, a hand-laid safetensors file), so the
directory is identical on every machine and with every library version.

The weights are random: the model produces fluent-looking nonsense, which is all the engine needs.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from kvc.runtime.models import byte_tokenizer as tok

VERSION = "v1"
DIR_NAME = f"default-model-{VERSION}"
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


def default_model_dir(cache_dir: str | Path | None = None) -> Path:
    """Where the default model lives: <cache>/default-model-v1, cache = $KVC_CACHE_DIR or
    ~/.cache/kvc."""
    root = cache_dir or os.environ.get("KVC_CACHE_DIR") or Path.home() / ".cache" / "kvc"
    return Path(root).expanduser() / DIR_NAME


def ensure_default_model(cache_dir: str | Path | None = None) -> Path:
    """The default model's directory, generated on first use (atomically: a finished directory
    is renamed into place, so readers never see a partial one)."""
    target = default_model_dir(cache_dir)
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{DIR_NAME}-", dir=target.parent))
    try:
        write_default_model(staging)
        os.rename(staging, target)
    except OSError:
        if not target.is_dir():  # not a lost race with another process: a real failure
            raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def write_default_model(directory: Path) -> None:
    """Write every file of the default model into an existing directory."""
    tok.write_json(directory / "config.json", CONFIG)
    tok.write_json(directory / "generation_config.json", GENERATION_CONFIG)
    tok.write_tokenizer(directory, model_max_length=CONFIG["max_position_embeddings"])
    write_safetensors(directory / "model.safetensors", default_weights())


def default_weights() -> dict[str, np.ndarray]:
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
