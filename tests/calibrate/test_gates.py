"""`kvc calibrate` (runtime/calibrate/): DuoAttention's gates trained on a tiny random model.

- The mixed attention at alpha = 1 is full attention, at alpha = 0 the streaming pattern
  (sink + recent per query), checked against attention written out by hand.
- A few steps on the tiny model move the gates (below 1, not all equal), and the file the command
  writes is the input the engine loads: DuoAttention then serves from it.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from kvc.runtime.calibrate.cli import add_command
from kvc.runtime.calibrate.gates import GateConfig, _Mixer, calibrate, streaming_mask
from kvc.runtime.config import EngineConfig
from kvc.runtime.engine import Engine
from kvc.runtime.llm import LLM
from kvc.runtime.models.method_inputs import load_input
from tests.models.tiny import make_tiny_llama
from tests.runtime.test_contract_methods import greedy, prompt


def by_hand(q, k, v, visible):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    logits = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    return logits.masked_fill(~visible, float("-inf")).softmax(-1) @ v


def test_mixed_attention_is_full_at_one_and_streaming_at_zero() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 12, 8, generator=g), torch.randn(1, 2, 12, 8, generator=g), \
        torch.randn(1, 2, 12, 8, generator=g)
    mixer = _Mixer(kv_heads=2, sink=2, recent=3)
    layer = SimpleNamespace(layer_idx=0)
    causal = torch.ones(12, 12, dtype=torch.bool).tril()
    full, stream = by_hand(q, k, v, causal), by_hand(q, k, v, streaming_mask(12, 2, 3))
    assert streaming_mask(12, 2, 3)[11].tolist() == [True, True] + [False] * 7 + [True] * 3
    mixer.alpha = torch.tensor([[1.0, 0.0]])
    out = mixer(layer, q, k, v, None)[0].transpose(1, 2)
    torch.testing.assert_close(out[:, :2], full[:, :2], atol=1e-5, rtol=1e-5)  # KV head 0: query heads 0, 1
    torch.testing.assert_close(out[:, 2:], stream[:, 2:], atol=1e-5, rtol=1e-5)
    assert (full - stream).abs().max() > 1e-2


def test_a_few_steps_move_the_gates_and_the_engine_loads_them(tmp_path: Path) -> None:
    model_dir = make_tiny_llama(tmp_path, seed=3, tokenizer=True, num_hidden_layers=2, initializer_range=0.25)
    cfg = GateConfig(sink=2, recent=8, context=256, samples=2, steps=6, lr=0.05, tail=8, bf16=False, l1=20.0)
    result = calibrate(model_dir, cfg)
    assert result.gate.shape == (2, 2) and len(result.losses) == 6
    assert (result.gate < 1).any() and (result.gate >= 0).all() and (result.gate <= 1).all()
    assert len(set(result.gate.flatten().tolist())) > 1, "every gate moved alike: nothing ranks the heads"

    import argparse

    parser = argparse.ArgumentParser()
    add_command(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["calibrate", "duoattention", "--model", str(model_dir), "--context", "256",
                              "--steps", "3", "--samples", "1", "--float32", "--l1", "20"])
    assert args.func(args) == 0
    written = model_dir / "duo_attention_heads.safetensors"
    gate = load_input(written, "gate")
    assert gate.shape == (2, 2) and (gate < 1).any()
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", page_size=4,
                          attention_backend="torch", kv_cache_memory=2**22, method="duoattention",
                          method_params={"sink": 2, "recent": 4})
    llm = LLM.from_engine(Engine(config))
    assert sum(map(sum, llm.engine.method.roles.masks["streaming"])) == 2  # half of 4 heads stream
    assert len(llm.generate(prompt(20, 1), greedy(4))[0].token_ids) == 4
