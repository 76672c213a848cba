"""Where a decode step's host time goes, on the device the engine runs on: cProfile over
`Engine.step` for a batch of decoding requests on a narrow random Qwen3 of the real layer and
KV-head counts (the host work scales with layers x KV heads x batch, not with the model's width),
with the GPU time of the same steps for comparison.

    python bench/host_profile.py --method duoattention --layers 48 --kv-heads 4 --batch 16 --prompt 4096
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", default="full")
    p.add_argument("--method-param", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt", type=int, default=4096)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--evict-interval", type=int, default=64)
    p.add_argument("--top", type=int, default=35)
    a = p.parse_args()

    from kvc.runtime.server.launch import parse_method_params as parse_pairs
    from kvc.runtime.config import EngineConfig
    from kvc.runtime.engine import Engine
    from kvc.runtime.models.method_inputs import save_input
    from kvc.runtime.sampling_params import SamplingParams
    from tests.models.tiny import make_tiny_qwen3

    root = Path(tempfile.mkdtemp())
    model = make_tiny_qwen3(root, num_hidden_layers=a.layers, num_key_value_heads=a.kv_heads,
                            num_attention_heads=2 * a.kv_heads, hidden_size=128, head_dim=128, intermediate_size=64,
                            max_position_embeddings=a.prompt + a.steps + 64)
    save_input(model / "duo_attention_heads.safetensors", "gate",
               torch.rand(a.layers, a.kv_heads, generator=torch.Generator().manual_seed(0)))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    memory = (24 if device == "cuda" else 1) * 2**30
    engine = Engine(EngineConfig(model=str(model), dtype="bfloat16", device=device, method=a.method,
                                 method_params=parse_pairs(a.method_param) if a.method_param else {},
                                 evict_interval=a.evict_interval, kv_cache_memory=memory, max_num_seqs=a.batch,
                                 max_model_len=a.prompt + a.steps + 64))
    g = torch.Generator().manual_seed(1)
    for _ in range(a.batch):
        engine.add_request(torch.randint(3, 300, (a.prompt,), generator=g).tolist(),
                           SamplingParams(max_tokens=a.steps + 32, temperature=0, ignore_eos=True))
    while any(s.is_prefill for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(8):  # graphs captured, warm
        engine.step()
    sync()
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    for _ in range(a.steps):
        engine.step()
    sync()
    prof.disable()
    ms = (time.perf_counter() - t) / a.steps * 1e3
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(a.top)
    print(f"{a.method}: batch {a.batch}, {a.layers} layers x {a.kv_heads} KV heads, {ms:.2f} ms a step (profiled)")
    print(out.getvalue())


if __name__ == "__main__":
    main()
