"""Full-size published model shapes, for random-weight benchmarks (`random:NAME`).

Each entry is the architecture part of the model's published config.json. Speed does not depend
on weight values, so a benchmark can run Qwen3-30B-A3B's exact shapes without downloading it.
"""

from __future__ import annotations

from typing import Any

from transformers import AutoConfig

from kvc.runtime.errors import ModelLoadError

_QWEN3_COMMON: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "attention_bias": False,
    "use_sliding_window": False,
    "bos_token_id": 151643,
    "eos_token_id": [151645, 151643],
    "dtype": "bfloat16",
}

_LLAMA3_COMMON: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "dtype": "bfloat16",
}

NAMED_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {
        **_QWEN3_COMMON,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "tie_word_embeddings": True,
    },
    "qwen3-1.7b": {
        **_QWEN3_COMMON,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "tie_word_embeddings": True,
    },
    "qwen3-4b": {
        **_QWEN3_COMMON,
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": True,
    },
    "qwen3-8b": {
        **_QWEN3_COMMON,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    },
    "qwen3-30b-a3b": {
        **_QWEN3_COMMON,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "tie_word_embeddings": False,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "llama3-8b": {
        **_LLAMA3_COMMON,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 8192,
        "eos_token_id": 128001,
    },
    "llama3.1-8b": {
        **_LLAMA3_COMMON,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "eos_token_id": [128001, 128008, 128009],
    },
    # GLM-4.7-Flash (transformers' `glm4_moe_lite` defaults are its shape): MLA with a 512 latent and a
    # 64-channel RoPE key, one dense layer (the config's default layer types), then 64 routed experts (top 4,
    # one group) and a shared one
    "glm-4.7-flash": {
        "architectures": ["Glm4MoeLiteForCausalLM"],
        "model_type": "glm4_moe_lite",
        "vocab_size": 154880,
        "hidden_size": 2048,
        "intermediate_size": 10240,
        "moe_intermediate_size": 1536,
        "num_hidden_layers": 47,
        "num_attention_heads": 20,
        "num_key_value_heads": 20,
        "q_lora_rank": 768,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 192,
        "qk_rope_head_dim": 64,
        "v_head_dim": 256,
        "n_routed_experts": 64,
        "n_shared_experts": 1,
        "num_experts_per_tok": 4,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.8,
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "max_position_embeddings": 202752,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    },
}


def named_config(name: str, **overrides: Any) -> Any:
    """The transformers config of a named model (fields in `overrides` replace published ones)."""
    fields = NAMED_CONFIGS.get(name.lower())
    if fields is None:
        raise ModelLoadError(
            f"unknown model name {name!r}; known names: tiny (the test model), {', '.join(sorted(NAMED_CONFIGS))}"
        )
    fields = {**fields, **overrides}
    return AutoConfig.for_model(fields.pop("model_type"), **fields)
