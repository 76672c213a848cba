"""KeyDiff written as a new user would (keys normalised by a reduced tensor, compared with the mean
key: [kv_head, key, channel] against [kv_head, key] and [kv_head, channel]), compiled from a .kvm
in a temporary folder through the compile cache and served by the engine on a tiny random Llama:
each layer and KV head keeps the tokens a hand-written KeyDiff score keeps, also where one KV head
and a prompt as long as the head dimension would let a position-aligned lowering run silently."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvc.compiler import cache
from kvc.runtime.sampling_params import SamplingParams
from tests.models.tiny import make_tiny_llama
from tests.references import model_forward as mf
from tests.runtime.test_compiled_methods import make_llm, prompts_of

KEYDIFF = """method keydiff : eviction
param budget: tokens = 256 in [1, 1048576]
on prefill_end:
  kn = k / norm(k, over channel)
  anchor = mean(kn, over key)
  score = -sum(kn * anchor, over channel)
  keep top(score, budget, per kv_head)
"""


def keydiff_keeps(k: torch.Tensor, budget: int) -> list[torch.Tensor]:
    """The tokens KeyDiff keeps per KV head of k [Hkv, T, D]: the `budget` keys least similar to
    the mean normalised key (ties to the older token), ascending."""
    normalised = k / k.norm(dim=-1, keepdim=True)
    score = -(normalised * normalised.mean(dim=1, keepdim=True)).sum(dim=-1)
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices
    return [row[:budget].sort().values for row in order]


@pytest.fixture(autouse=True)
def cache_root(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "kvc-cache"))
    return tmp_path / "kvc-cache" / "methods"


@pytest.mark.parametrize("kv_heads,length,budget", [(2, 40, 12), (1, 16, 6)],
                         ids=["two-kv-heads", "one-kv-head-length-equals-head-dim"])
def test_keydiff_keeps_the_reference_tokens(tmp_path, cache_root, monkeypatch, kv_heads, length, budget):
    model_dir = make_tiny_llama(tmp_path / "model", num_key_value_heads=kv_heads)
    path = tmp_path / "keydiff.kvm"
    path.write_text(KEYDIFF)
    llm = make_llm(model_dir, str(path), {"budget": budget})
    method = llm.engine.method
    assert Path(method.lowering.__file__).parent.parent == cache_root  # compiled into the cache
    plans = {}
    served = method.prefill_end

    def recording(layer, view):
        plans[layer] = served(layer, view)
        return plans[layer]

    monkeypatch.setattr(method, "prefill_end", recording)
    prompt = prompts_of([length], seed=3)[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids if hasattr(out[0], "outputs") else out[0].token_ids) == 3

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    layers, _ = mf.prefill(hf, torch.tensor(prompt))
    assert sorted(plans) == list(range(len(layers)))
    for layer, recorded in enumerate(layers):
        plan = plans[layer]
        assert plan is not None and plan.lengths is None and plan.indices.shape == (kv_heads, budget)
        want = keydiff_keeps(recorded.k.float(), budget)
        for head in range(kv_heads):
            assert plan.indices[head].tolist() == want[head].tolist(), f"layer {layer}, kv head {head}"
