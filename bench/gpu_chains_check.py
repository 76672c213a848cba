"""GPU smoke check of chains for every served method (CUDA, fused kernels, Triton compaction):
turn 2 reuses turn 1's history (cached tokens), a rolled-back continuation runs, and a prune of
the chain's first 200 tokens (keep 20%, the method's scorer or snapkv) frees pages and the next turn
still reuses the whole history.
    python3 bench/gpu_chains_check.py            # on the GPU; prints one line per method
"""

from __future__ import annotations

import sys

import torch

from kvc import LLM
from kvc.runtime.chains import ChainSpec
from kvc.runtime.sampling_params import SamplingParams

PARAMS = {"full": {}, "streamingllm": {"sink": 4, "recent": 60}, "snapkv": {"budget": 64, "window": 8},
          "pyramidkv": {"budget": 64, "window": 8}, "h2o": {"heavy": 0.1, "recent": 0.1},
          "tova": {"budget": 64}, "adakv": {"budget": 64, "window": 8}}


def main() -> int:
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, 1000, (300,), generator=g).tolist()
    user = torch.randint(10, 1000, (40,), generator=g).tolist()
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    failed = 0
    for method, params in PARAMS.items():
        llm = LLM("random:qwen3-0.6b", method=method, method_params=params or None, device="cuda",
                  dtype="bfloat16", kv_cache_memory=2**28)
        try:
            first = llm.generate(prompt, greedy, chain=ChainSpec(open=True))[0]
            history = prompt + list(first.token_ids)
            second = llm.generate(history + user, greedy, chain=ChainSpec(continue_id=first.chain_id))[0]
            # the chain now holds turn 2 too (continuing keeps the id): fork it with a turn 3
            convo = history + user + list(second.token_ids)
            fork = llm.generate(convo + user, greedy, chain=ChainSpec(fork_id=first.chain_id))[0]
            cut = convo + user + list(fork.token_ids)[:5] + user  # a stop-string-like cut of the fork's turn
            ok = second.num_cached_tokens == len(history) - 1
            try:
                third = llm.generate(cut, greedy, chain=ChainSpec(continue_id=fork.chain_id))[0]
                rolled = third.num_cached_tokens
            except Exception as err:  # noqa: BLE001 -- report, TOVA may refuse (409)
                rolled = f"{type(err).__name__}: {err}"
            from kvc.runtime.chain_prune import PruneRequest

            report = llm.engine.prune_chain(first.chain_id, None, PruneRequest(token_ranges=((0, 200),), keep=0.2))
            fourth = llm.generate(convo + user, greedy, chain=ChainSpec(continue_id=first.chain_id))[0]
            pruned_ok = fourth.num_cached_tokens == len(convo) - 1 and report["pages"] <= report["pages_before"]
            print(f"{method}: turn-2 cached {second.num_cached_tokens}/{len(history) - 1} "
                  f"{'OK' if ok else 'WRONG'}; cut continuation cached {rolled}; prune pages "
                  f"{report['pages_before']}->{report['pages']}, then cached {fourth.num_cached_tokens}/"
                  f"{len(convo) - 1} {'OK' if pruned_ok else 'WRONG'}", flush=True)
            failed += not (ok and pruned_ok)
        except Exception as err:  # noqa: BLE001
            print(f"{method}: FAILED {type(err).__name__}: {err}", flush=True)
            failed += 1
        del llm
        torch.cuda.empty_cache()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
