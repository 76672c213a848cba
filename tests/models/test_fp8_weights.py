"""FP8 weights (runtime/models/fp8_weights.py): checkpoints in the block-wise e4m3 format of the published
FP8 models, loaded through the real loader, generate the greedy tokens transformers generates from the same
weights dequantized (tests/models/fp8_checkpoint.py writes both), float32 on the CPU: tiny Qwen3 with blocks
that do not divide its layers (partial row and column blocks, q/k/v and gate/up fused across them) and tiny
Qwen3-MoE with per-expert FP8 tensors. The weights stay one byte each; unsupported formats and a fused layer
of mixed formats are clear errors.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvc.runtime.errors import UnsupportedArchitectureError
from kvc.runtime.llm import LLM
from kvc.runtime.models.fp8_weights import CODES, Fp8Linear
from kvc.runtime.models.loader import load_model
from kvc.runtime.sampling_params import SamplingParams
from tests.models.fp8_checkpoint import write_fp8
from tests.models.tiny import make_tiny_glm4_moe_lite, make_tiny_qwen3, make_tiny_qwen3_moe, reference_attention

BLOCK = (24, 40)  # neither divides 64 (hidden), 16 x 4 (q), 16 x 2 (k, v) nor 128 (intermediate)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in (11, 40)]


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "glm4_moe_lite"])
def test_fp8_checkpoint_generates_the_dequantized_models_tokens(tmp_path, arch):
    make = {"qwen3": make_tiny_qwen3, "qwen3_moe": make_tiny_qwen3_moe, "glm4_moe_lite": make_tiny_glm4_moe_lite}[arch]
    fp8_dir = write_fp8(make(tmp_path / "src", seed=5, initializer_range=0.2), tmp_path / "fp8", BLOCK)
    hf = AutoModelForCausalLM.from_pretrained(fp8_dir / "dequantized", dtype=torch.float32).eval()
    llm = LLM(str(fp8_dir), device="cpu", dtype="float32", page_size=8)
    model = llm.engine.model
    fp8 = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert fp8 and all(m.weight.dtype == CODES for m in fp8)
    assert model.compute_logits is not None and model.lm_head.weight.dtype == torch.float32  # not quantized
    if arch != "qwen3":  # the first sparse layer's experts (GLM's layer 0 is dense)
        experts = next(m.mlp.experts for m in model.layers if hasattr(m.mlp, "experts"))
        assert experts.gate_up_proj.dtype == CODES and experts.down_proj.dtype == CODES
    outs = llm.generate(_prompts(), SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    for prompt, out in zip(_prompts(), outs):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                               pad_token_id=0)
        assert out.token_ids == want[0, len(prompt):].tolist()


def test_fp8_logits_equal_the_dequantized_models(tmp_path):
    """The first token's logits: the same products as the dequantized checkpoint's (float32)."""
    fp8_dir = write_fp8(make_tiny_qwen3(tmp_path / "src", seed=6), tmp_path / "fp8", BLOCK)
    ours = load_model(fp8_dir).model
    theirs = load_model(fp8_dir / "dequantized").model
    ids = torch.tensor(_prompts()[1])
    with torch.no_grad():
        got = ours.compute_logits(ours(ids, torch.arange(ids.numel()), reference_attention()))
        want = theirs.compute_logits(theirs(ids, torch.arange(ids.numel()), reference_attention()))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_unsupported_quantization_is_a_clear_error(tmp_path):
    src = make_tiny_qwen3(tmp_path / "src", seed=1)
    config = json.loads((src / "config.json").read_text())
    for quantization, match in (({"quant_method": "awq", "bits": 4}, "block-wise FP8 format only"),
                                ({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                  "activation_scheme": "static"}, "static activation scales")):
        (src / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
        with pytest.raises(UnsupportedArchitectureError, match=match):
            load_model(src)


def test_a_fused_layer_of_mixed_formats_is_an_error(tmp_path):
    """q_proj in FP8 but k_proj not: one fused qkv weight cannot hold both."""
    src = make_tiny_qwen3(tmp_path / "src", seed=1)
    only_q = lambda name, t: name.endswith("self_attn.q_proj.weight")  # noqa: E731
    fp8_dir = write_fp8(src, tmp_path / "fp8", BLOCK, quantize=only_q)
    with pytest.raises(UnsupportedArchitectureError, match="FP8 and unquantized"):
        load_model(fp8_dir)


def test_random_weight_fp8_shape_for_benchmarks():
    """`random:NAME,fp8_block=N`: the layers' weights as the published FP8 files store them (codes and
    square-block scales; routers, norms, embedding and LM head as they are), N(0, 0.02) once dequantized."""
    from kvc.runtime.models.loader import resolve_model

    shape = ("num_hidden_layers=2,hidden_size=64,intermediate_size=64,moe_intermediate_size=32,num_experts=4,"
             "num_experts_per_tok=2,num_attention_heads=4,num_key_value_heads=2,head_dim=16,vocab_size=320")
    model = resolve_model(f"random:qwen3-30b-a3b,{shape},fp8_block=32", "cpu", torch.float32).model
    attention = model.layers[0].self_attn.qkv_proj
    assert isinstance(attention, Fp8Linear) and attention.weight.dtype == CODES
    assert attention.weight_scale.shape == (attention.out_features, 2)  # 64 columns in blocks of 32
    assert model.layers[1].mlp.experts.down_proj.dtype == CODES
    assert model.layers[0].mlp.gate.weight.dtype == torch.float32 and model.lm_head.weight.dtype == torch.float32
    assert abs(float(attention.dequantized(torch.float32).std()) - 0.02) < 0.002
    hidden = model(torch.tensor([5, 6, 7]), torch.arange(3), reference_attention())
    assert torch.isfinite(model.compute_logits(hidden)).all()
