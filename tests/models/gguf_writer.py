"""Write a tiny Hugging Face checkpoint as a GGUF file, the way llama.cpp lays one out, so that
`--model gguf:PATH` can be tested on Llama, Qwen3 and Qwen3-MoE without any download.

Written from the GGUF format's public conventions (gguf-py's tensor name map and metadata keys):
float32 tensors under llama.cpp's names, Llama's q/k rows permuted into llama.cpp's rotary
order (which the reader undoes), Qwen3-MoE's per-expert weights stacked into
ffn_{gate,up,down}_exps, and kvc's byte-level test tokenizer (runtime/models/byte_tokenizer.py)
as a `gpt2` vocabulary with its merges and ChatML control tokens. The model's vocab must be the byte
tokenizer's (`byte_tokenizer.VOCAB_SIZE`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from kvc.runtime.models import byte_tokenizer

_ARCH = {"llama": "LLAMA", "qwen3": "QWEN3", "qwen3_moe": "QWEN3MOE"}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face's rotate-half row order -> llama.cpp's interleaved pairs, per head."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model_dir: Path, out: Path) -> Path:
    import gguf

    config = json.loads((model_dir / "config.json").read_text())
    model_type = config["model_type"]
    arch = getattr(gguf.MODEL_ARCH, _ARCH[model_type])
    layers, heads, kv_heads = config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    assert config["vocab_size"] == byte_tokenizer.VOCAB_SIZE, "build the model with the byte tokenizer's vocab"
    rope = config.get("rope_parameters") or {}
    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(f"tiny-{model_type}")
    writer.add_block_count(layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    if model_type == "qwen3_moe":
        writer.add_expert_count(config.get("num_experts") or config["num_local_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])

    vocab = byte_tokenizer.vocabulary()
    tokens = sorted(vocab, key=vocab.get)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    control = set(byte_tokenizer.SPECIAL_TOKENS)
    writer.add_token_types([gguf.TokenType.CONTROL if t in control else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([f"{a} {b}" for a, b in byte_tokenizer.MERGES])
    writer.add_bos_token_id(vocab["<|im_start|>"])
    writer.add_eos_token_id(vocab[byte_tokenizer.EOS_TOKEN])
    writer.add_pad_token_id(vocab[byte_tokenizer.PAD_TOKEN])
    writer.add_add_bos_token(False)
    writer.add_chat_template(byte_tokenizer.CHAT_TEMPLATE)

    names = gguf.get_tensor_name_map(arch, layers)
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}  # (layer, gate|up|down) -> expert -> weight
    for hf_name, tensor in sorted(load_file(str(model_dir / "model.safetensors")).items()):
        base = hf_name.removesuffix(".weight")
        parts = base.split(".")
        if "experts" in parts:  # model.layers.L.mlp.experts.E.{gate,up,down}_proj: stacked per layer
            experts.setdefault((parts[2], parts[6].removesuffix("_proj")), {})[int(parts[5])] = tensor
            continue
        name = names.get_name(base)
        assert name is not None, f"no GGUF name for {hf_name}"
        if model_type == "llama" and base.endswith("q_proj"):
            tensor = _permute(tensor, heads)
        elif model_type == "llama" and base.endswith("k_proj"):
            tensor = _permute(tensor, kv_heads)
        writer.add_tensor(f"{name}.weight", np.ascontiguousarray(tensor, dtype=np.float32))
    for (layer, which), by_expert in sorted(experts.items()):  # [E, I, H] gate/up, [E, H, I] down
        stacked = np.stack([by_expert[e] for e in sorted(by_expert)])
        writer.add_tensor(f"blk.{layer}.ffn_{which}_exps.weight", np.ascontiguousarray(stacked, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
