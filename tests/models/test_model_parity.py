"""kvc's model code against Hugging Face's: same checkpoint, same logits (float32, CPU).

Each case saves a tiny random HF checkpoint, loads it through kvc's loader, runs kvc's model with
a plain causal attention (tests/models/tiny.py), and compares logits with the HF model's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kvc.runtime.models.loader import load_model
from kvc.runtime.models.rope import RopeSettings, inverse_frequencies
from tests.models.tiny import (
    LLAMA3_ROPE_SCALING,
    load_hf,
    make_tiny_llama,
    make_tiny_qwen3,
    make_tiny_qwen3_moe,
    reference_attention,
)

ATOL = 1e-5

CASES = {
    "llama": (make_tiny_llama, {}),
    "llama-rope-llama3": (make_tiny_llama, {"rope_scaling": LLAMA3_ROPE_SCALING}),
    "llama-bias-tied": (
        make_tiny_llama,
        {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True},
    ),
    "qwen3": (make_tiny_qwen3, {}),
    "qwen3-tied": (make_tiny_qwen3, {"tie_word_embeddings": True}),
    "qwen3-moe-norm-topk": (make_tiny_qwen3_moe, {"norm_topk_prob": True}),
    "qwen3-moe-no-norm-mixed": (
        make_tiny_qwen3_moe,
        {"norm_topk_prob": False, "num_hidden_layers": 4, "mlp_only_layers": [0], "decoder_sparse_step": 2},
    ),
}


def hf_logits(hf, ids: torch.Tensor, start: int = 0) -> torch.Tensor:
    positions = torch.arange(start, start + ids.numel())[None]
    with torch.no_grad():
        return hf(ids[None], position_ids=positions).logits[0]


def kvc_logits(model, ids: torch.Tensor, positions: torch.Tensor, seq_lens=None) -> torch.Tensor:
    with torch.no_grad():
        return model.compute_logits(model(ids, positions, reference_attention(seq_lens)))


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(case: str, tmp_path: Path) -> None:
    make, overrides = CASES[case]
    path = make(tmp_path, **overrides)
    hf, loaded = load_hf(path), load_model(path)
    ids_a = torch.randint(0, 320, (23,), generator=torch.Generator().manual_seed(1))
    ids_b = torch.randint(0, 320, (9,), generator=torch.Generator().manual_seed(2))

    # One sequence.
    got = kvc_logits(loaded.model, ids_a, torch.arange(23))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, hf_logits(hf, ids_a), atol=ATOL, rtol=0)

    # Two sequences in one flat step; the second starts at position 90 (past the llama3 rope's
    # original context of 64, where its scaling matters).
    ids = torch.cat([ids_a, ids_b])
    positions = torch.cat([torch.arange(23), torch.arange(90, 99)])
    got = kvc_logits(loaded.model, ids, positions, seq_lens=[23, 9])
    want = torch.cat([hf_logits(hf, ids_a), hf_logits(hf, ids_b, start=90)])
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_moe_layers_follow_sparse_step_and_mlp_only_layers(tmp_path: Path) -> None:
    path = make_tiny_qwen3_moe(tmp_path, num_hidden_layers=4, mlp_only_layers=[3], decoder_sparse_step=2)
    kinds = [type(layer.mlp).__name__ for layer in load_model(path).model.layers]
    assert kinds == ["GatedMLP", "SparseMoeBlock", "GatedMLP", "GatedMLP"]


def test_fused_expert_checkpoint_layout_loads(tmp_path: Path) -> None:
    """transformers >= 5 may save experts as stacked gate_up_proj/down_proj tensors."""
    path = make_tiny_qwen3_moe(tmp_path, num_hidden_layers=2)
    per_expert = load_model(path).model
    tensors = load_file(path / "model.safetensors")
    for layer in range(2):
        prefix = f"model.layers.{layer}.mlp.experts"
        gate_up, down = [], []
        for e in range(8):
            gate = tensors.pop(f"{prefix}.{e}.gate_proj.weight")
            up = tensors.pop(f"{prefix}.{e}.up_proj.weight")
            gate_up.append(torch.cat([gate, up]))
            down.append(tensors.pop(f"{prefix}.{e}.down_proj.weight"))
        tensors[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        tensors[f"{prefix}.down_proj"] = torch.stack(down)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    fused = load_model(path).model
    for (name, a), (_, b) in zip(per_expert.state_dict().items(), fused.state_dict().items()):
        assert torch.equal(a, b), name


def test_llama3_rope_frequencies_match_transformers(tmp_path: Path) -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=512, num_attention_heads=4, rope_theta=500000.0, max_position_embeddings=131072,
        rope_scaling={**LLAMA3_ROPE_SCALING, "original_max_position_embeddings": 8192},
    )  # fmt: skip
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    got = inverse_frequencies(RopeSettings.from_config(config), 128)
    assert RopeSettings.from_config(config).rope_type == "llama3"
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert not torch.equal(got, inverse_frequencies(RopeSettings(theta=500000.0), 128))


def test_rope_settings_read_old_style_attributes() -> None:
    class OldConfig:  # transformers 4 style: rope_theta + rope_scaling with "type"
        rope_theta = 1234.0
        rope_scaling = {"type": "llama3", "factor": 2.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
        max_position_embeddings = 4096

    settings = RopeSettings.from_config(OldConfig())
    assert (settings.theta, settings.rope_type, settings.factor) == (1234.0, "llama3", 2.0)
    assert settings.original_max_position_embeddings == 4096
