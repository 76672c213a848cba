"""GLM-4.7-Flash's model code (runtime/models/glm4_moe_lite.py) against transformers' `glm4_moe_lite`.

Tiny random checkpoints (tests/models/tiny.py `make_tiny_glm4_moe_lite`) loaded through kvc's checkpoint
layout (`load_checkpoint`: every tensor placed, none left over), float32 on the CPU. The model calls its
attention in MLA's absorbed form (q [T, heads, latent + rope], one latent key [T, 1, latent + rope], the
latent as the value); here a plain causal attention over those, with the model's `attention_scale`, stands in
for the engine (which does not serve the latent cache yet). Checked: the prompt's logits equal transformers'
(decompressed per-head keys and values), and greedy decoding over a cache of latents gives transformers'
greedy tokens, for a config with one dense layer and a query low-rank and one with three dense layers and a
full-rank query projection. Then the same through the engine (`LLM`, method `full`): its paged latent cache
(one tensor of latent + RoPE channels per token, the values a view of it), batched prompts in chunks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvc.runtime.kv.spec import Extent
from kvc.runtime.llm import LLM
from kvc.runtime.models.glm4_moe_lite import Glm4MoeLiteForCausalLM
from kvc.runtime.models.registry import make_spec
from kvc.runtime.models.weights import load_checkpoint
from kvc.runtime.sampling_params import SamplingParams
from tests.models.tiny import load_hf, make_tiny_glm4_moe_lite

CONFIGS = {"one dense layer": {}, "three dense layers": {"num_hidden_layers": 5, "dense_layers": 3,
                                                         "q_lora_rank": None}}


def _load(model_dir: Path) -> tuple[Glm4MoeLiteForCausalLM, object]:
    hf = load_hf(model_dir)
    config = hf.config
    spec = make_spec(Glm4MoeLiteForCausalLM, config, torch.float32, (2,))
    with torch.device("meta"):
        model = Glm4MoeLiteForCausalLM(config, spec)
    model = model.to_empty(device="cpu")
    model.init_buffers()
    load_checkpoint(model, model_dir, torch.device("cpu"))
    return model.eval().requires_grad_(False), hf


class LatentCache:
    """A causal attention over the absorbed q and the cached latent keys/values of every layer."""

    def __init__(self, scale: float) -> None:
        self.scale, self.keys, self.values = scale, {}, {}

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, latent=None) -> torch.Tensor:
        assert k.shape[1] == v.shape[1] == 1 and k.shape[2] == v.shape[2] + 8  # latent + RoPE part
        keys = torch.cat([self.keys.get(layer, k[:0]), k])
        values = torch.cat([self.values.get(layer, v[:0]), v])
        self.keys[layer], self.values[layer] = keys, values
        n, t = keys.shape[0], q.shape[0]
        logits = torch.einsum("thd,nd->htn", q, keys[:, 0]) * self.scale
        future = torch.arange(n)[None, :] > torch.arange(n - t, n)[:, None]
        probs = logits.masked_fill(future, float("-inf")).softmax(dim=-1)
        return latent.values(torch.einsum("htn,nr->thr", probs, values[:, 0]))  # up-projected


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prompt_logits_and_greedy_tokens_equal_transformers(tmp_path, name):
    model_dir = make_tiny_glm4_moe_lite(tmp_path, seed=3, **CONFIGS[name])
    model, hf = _load(model_dir)
    prompt = torch.randint(3, 300, (37,), generator=torch.Generator().manual_seed(5))
    cache = LatentCache(model.attention_scale)
    hidden = model(prompt, torch.arange(prompt.numel()), cache)
    with torch.no_grad():
        want = hf(prompt[None]).logits[0].float()
    torch.testing.assert_close(model.compute_logits(hidden), want, rtol=1e-4, atol=1e-4)

    tokens = [int(model.compute_logits(hidden[-1:]).argmax())]
    for step in range(15):
        position = torch.tensor([prompt.numel() + step])
        hidden = model(torch.tensor(tokens[-1:]), position, cache)
        tokens.append(int(model.compute_logits(hidden).argmax()))
    with torch.no_grad():
        out = hf.generate(prompt[None], max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert tokens == out[0, prompt.numel():].tolist()


@pytest.mark.parametrize("form", ["absorbed", "decompressed"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_served_full_gives_transformers_greedy_tokens(tmp_path, name, form):
    """Chunked prompts (chunks over a cached prefix), prefilled in either MLA form (`mla_prefill`)."""
    model_dir = make_tiny_glm4_moe_lite(tmp_path, seed=6, **CONFIGS[name])
    hf = load_hf(model_dir)
    llm = LLM(str(model_dir), method="full", device="cpu", dtype="float32", page_size=4, attention_backend="torch",
              max_num_batched_tokens=64, max_prefill_chunk=20, mla_prefill=form)
    assert llm.engine.attention.mla_prefill == form
    store = llm.engine.attention.stores[0]
    latent = hf.config.kv_lora_rank + hf.config.qk_rope_head_dim
    assert [(t.name, t.shape) for t in store.spec.of(Extent.TOKEN)] == [("k", (latent,))]
    assert store.spec.bytes_per_token(llm.engine.layout.kv_heads) == latent * 4  # one latent head, float32
    assert store.v_cache.shape[-1] == hf.config.kv_lora_rank
    assert store.v_cache.untyped_storage().data_ptr() == store.k_cache.untyped_storage().data_ptr()
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (9, 37, 70)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                               pad_token_id=0)
        assert out.token_ids == want[0, len(prompt):].tolist()


def test_router_keeps_the_best_group():
    """Group-limited routing: with `topk_group` 1 of 2 groups, both chosen experts come from the group whose
    two best corrected scores sum highest; the weights are the uncorrected sigmoid scores, normalised, times
    the routed scaling factor."""
    from transformers import Glm4MoeLiteConfig

    from kvc.runtime.models.glm4_moe_lite import LatentMoE

    config = Glm4MoeLiteConfig(hidden_size=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                               moe_intermediate_size=4, n_shared_experts=1, routed_scaling_factor=2.0,
                               norm_topk_prob=True)
    moe = LatentMoE(config)
    with torch.no_grad():
        moe.gate.weight.copy_(torch.eye(8, 4) * 3)  # expert e scores x[e] (e < 4), 0 for the others
        moe.score_bias.copy_(torch.tensor([0, 0, 0, 0, 0.4, 0.4, 0, 0]))
    x = torch.tensor([[1.0, 0.5, -2.0, -2.0]])  # group 0: sigmoid(3), sigmoid(1.5); group 1: 0.9, 0.9 corrected
    ids, weights = moe.route(x)
    assert sorted(ids[0].tolist()) == [4, 5]  # group 1 wins on its corrected scores (1.8 > 0.95 + 0.82)
    torch.testing.assert_close(weights[0], torch.tensor([1.0, 1.0]))  # sigmoid(0) each, normalised, x 2


def test_an_unknown_mla_prefill_form_is_a_config_error(tmp_path):
    from kvc.runtime.errors import ConfigError

    with pytest.raises(ConfigError, match="mla_prefill must be one of auto, absorbed, decompressed"):
        LLM(str(make_tiny_glm4_moe_lite(tmp_path, seed=6)), device="cpu", mla_prefill="latent")


def test_methods_the_latent_cache_cannot_hold_are_config_errors(tmp_path):
    """KIVI stores values apart from keys (integer codes per group): on the latent cache, a ConfigError that
    says so, before any memory is allocated."""
    from kvc.runtime.errors import ConfigError

    model_dir = make_tiny_glm4_moe_lite(tmp_path, seed=1)
    with pytest.raises(ConfigError, match="latent KV cache"):
        LLM(str(model_dir), method="kivi", method_params={"group_size": 8, "residual_length": 32}, device="cpu",
            dtype="float32", page_size=8)


def test_mixed_full_and_fp8_latents_in_one_batch(tmp_path):
    """Two attention groups (bf16/float latents and FP8 latents) in one forward: each layer's attention call
    carries its group's rows of the decompressed queries (`LatentQueries.rows`); every request gets its
    one-method tokens."""
    model_dir = str(make_tiny_glm4_moe_lite(tmp_path, seed=3))
    options = dict(device="cpu", dtype="float32", page_size=4, attention_backend="torch", max_num_batched_tokens=128,
                   max_prefill_chunk=24)
    params = {"fp8": {"scale": "dynamic"}}
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (30, 50, 41, 27)]
    which = ["full", "fp8", "full", "fp8"]
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    mixed = LLM(model_dir, method="full", methods=["fp8"], methods_params=params, **options)
    assert [[lane.key for lane in group.lanes] for group in mixed.engine.runner.groups] == [["full"], ["fp8"]]
    out = mixed.generate(prompts, greedy, method=which)
    for method in ("full", "fp8"):
        rows = [i for i, w in enumerate(which) if w == method]
        ref = LLM(model_dir, method=method, method_params=params.get(method), **options).generate(
            [prompts[i] for i in rows], greedy)
        assert [out[i].token_ids for i in rows] == [r.token_ids for r in ref], method
