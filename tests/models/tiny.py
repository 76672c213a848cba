"""Tiny random Hugging Face checkpoints and a reference attention, shared by kvc's tests.

`make_tiny_*` build a small transformers config (GQA, head_dim 16), seed torch, instantiate the
Hugging Face model and `save_pretrained` it (safetensors) into a fresh directory under `root`, so
tests exercise the real loading path without any download. With `tokenizer=True` the directory
also gets kvc's byte-level tokenizer (300 tokens, ids below the tiny vocab of 320), so it works
end to end with `AutoTokenizer` and text prompts. `reference_attention` is the plain
contiguous causal attention the parity tests plug into kvc models.

Import as `from tests.models.tiny import make_tiny_qwen3`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PreTrainedModel,
    Qwen3Config,
    Qwen3MoeConfig,
)

from kvc.runtime.models import byte_tokenizer
from kvc.runtime.models.base import plain_attention

_COMMON: dict[str, Any] = {
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "eos_token_id": 2,
    "bos_token_id": 1,
}

LLAMA3_ROPE_SCALING: dict[str, Any] = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

_counter = itertools.count()


def make_tiny_llama(root: Path, seed: int = 0, tokenizer: bool = False, **overrides: Any) -> Path:
    """Llama 3 layout; pass `rope_scaling=LLAMA3_ROPE_SCALING` for Llama 3.1 rope."""
    config = LlamaConfig(**{**_COMMON, "rope_theta": 500000.0, **overrides})
    return save_tiny(config, root, "llama", seed, tokenizer)


def make_tiny_qwen3(root: Path, seed: int = 0, tokenizer: bool = False, **overrides: Any) -> Path:
    config = Qwen3Config(**{**_COMMON, "rope_theta": 1000000.0, **overrides})
    return save_tiny(config, root, "qwen3", seed, tokenizer)


def make_tiny_qwen3_moe(
    root: Path, seed: int = 0, tokenizer: bool = False, **overrides: Any
) -> Path:
    """8 experts, top-2, every layer sparse unless `mlp_only_layers`/`decoder_sparse_step` say so."""
    fields = {
        **_COMMON,
        "num_hidden_layers": 3,
        "rope_theta": 1000000.0,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        **overrides,
    }
    return save_tiny(Qwen3MoeConfig(**fields), root, "qwen3_moe", seed, tokenizer)


def make_tiny_glm4_moe_lite(root: Path, seed: int = 0, tokenizer: bool = False, **overrides: Any) -> Path:
    """GLM-4.7-Flash's layout (`glm4_moe_lite`: MLA, group-limited sigmoid routing, a shared expert) at tiny
    sizes: a latent of 32 plus a RoPE key part of 8 (interleaved), 8 experts in 2 groups, top-2."""
    from transformers import Glm4MoeLiteConfig

    layers = overrides.pop("num_hidden_layers", 3)
    dense = overrides.pop("dense_layers", 1)
    fields = {
        **{k: v for k, v in _COMMON.items() if k not in ("head_dim", "num_key_value_heads")},
        "num_hidden_layers": layers,
        "num_key_value_heads": 4,
        "mlp_layer_types": ["dense"] * dense + ["sparse"] * (layers - dense),
        "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
        "v_head_dim": 24, "head_dim": 8, "rope_interleave": True,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
        "moe_intermediate_size": 32, "n_shared_experts": 1, "routed_scaling_factor": 1.8,
        "norm_topk_prob": True,
        **overrides,
    }
    return save_tiny(Glm4MoeLiteConfig(**fields), root, "glm4_moe_lite", seed, tokenizer)


def save_tiny(config: Any, root: Path, name: str, seed: int = 0, tokenizer: bool = False) -> Path:
    """Instantiate `config`'s Hugging Face model with seeded random weights and save it."""
    config.architectures = [config.__class__.__name__.replace("Config", "ForCausalLM")]
    if tokenizer:
        if config.vocab_size < byte_tokenizer.VOCAB_SIZE:
            raise ValueError(f"vocab_size must be >= {byte_tokenizer.VOCAB_SIZE} to add the tokenizer")
        config.bos_token_id = None
        config.eos_token_id = byte_tokenizer.token_id(byte_tokenizer.EOS_TOKEN)
        config.pad_token_id = byte_tokenizer.token_id(byte_tokenizer.PAD_TOKEN)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize_norms(model, seed)
    out = Path(root) / f"{name}-{next(_counter)}"
    model.save_pretrained(out, safe_serialization=True)
    if tokenizer:
        add_tokenizer(out)
    return out


def add_tokenizer(model_dir: Path) -> Path:
    """Write kvc's byte-level tokenizer into a tiny checkpoint (its vocab must hold its ids;
    `make_tiny_*(tokenizer=True)` also points the config's eos/pad ids at its special tokens)."""
    byte_tokenizer.write_tokenizer(Path(model_dir), model_max_length=512)
    return Path(model_dir)


def _randomize_norms(model: PreTrainedModel, seed: int) -> None:
    # HF initializes norm weights to exactly 1, which would hide a norm loaded into the wrong
    # place; perturb them so parity tests can see it.
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn(param.shape, generator=generator) * 0.1)
        for name, buffer in model.named_buffers():  # routers' score corrections start at 0 too
            if name.endswith("e_score_correction_bias"):
                buffer.add_(torch.randn(buffer.shape, generator=generator) * 0.1)


def load_hf(path: Path) -> PreTrainedModel:
    """The Hugging Face model of a tiny checkpoint, float32, eager attention, eval mode."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def reference_attention(seq_lens: Sequence[int] | None = None):
    """A kvc `AttentionFn` doing plain causal attention over the whole step, no cache.

    The flat batch holds sequences of `seq_lens` back to back (one sequence when None); each
    attends causally within itself only. GQA by repeating kv heads.
    """

    def attn(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        lens = list(seq_lens) if seq_lens is not None else [q.shape[0]]
        group = q.shape[1] // k.shape[1]
        outs = []
        for qs, ks, vs in zip(q.split(lens), k.split(lens), v.split(lens)):
            ks = ks.repeat_interleave(group, dim=1)
            vs = vs.repeat_interleave(group, dim=1)
            o = F.scaled_dot_product_attention(
                qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1), is_causal=True
            )
            outs.append(o.transpose(0, 1))
        return torch.cat(outs)

    return plain_attention(attn)  # an MLA model's absorbed outputs up-projected
