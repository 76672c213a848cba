"""`kvc bench throughput --requests N`: the whole run, as `vllm bench throughput` measures it.

N requests of the input length, each sized for the output length (random prompts, `ignore_eos`), are
submitted at once to one engine per method, whose KV pool is the same `--kv-memory` for every method and
whose seats are the method's planned batch (plan.py). The engine runs them to the end by itself:
continuous batching admits a request when its pages fit, prefills run in chunks beside the running
decodes, finished requests free their seats. Reported (`"mode": "offline"`), over the whole run from the
first submission to the last token, prefill included:
- `output_tok_s` = N x output / wall time, `requests_s` = N / wall time, `total_tok_s` with the prompts;
- `ttft_s` (mean), `ttft_p50_s`, `ttft_p99_s`: submission to each request's first token;
- `prefill_share`: the share of the engine's steps' time spent in steps that prefilled anything;
- `peak_running`: the most requests decoding at once.
The SnapKV/full ratio of `output_tok_s` is the headline users compare (`ratios_vs_full`, offline rows).
"""

from __future__ import annotations

import time

import numpy as np

from kvc.runtime.bench.steps import Clock, retire, collect, make_engine, prompt, warm_up
from kvc.runtime.sampling_params import SamplingParams


def offline_row(cfg, case) -> dict:
    """One (method, input length) run of `cfg.requests` requests end to end (module docstring)."""
    from kvc.runtime.methods import resolve_method

    plan, n = case.plan, cfg.requests
    row = {"method": case.method, "params": case.resolved, "input_len": case.input_len,
           "output_len": cfg.output_len, "mode": "offline", "requests": n, "batch": plan.batch,
           "pages_per_seq": plan.pages_per_seq}
    if plan.batch == 0:
        row["error"] = f"one request of {case.input_len} + {cfg.output_len} tokens does not fit the pool"
        return row
    engine = make_engine(cfg, case.model, resolve_method(case.method, case.params or None), case.params,
                         case.input_len, plan.batch)
    try:
        clock = Clock(engine.device)
        warm_up(engine, cfg, case.input_len)
        params = SamplingParams(max_tokens=cfg.output_len, temperature=cfg.temperature, ignore_eos=True)
        vocab = engine.spec.vocab_size
        clock.sync()
        start = time.perf_counter()
        seqs = [engine.add_request(prompt(vocab, case.input_len, cfg.seed + 1 + i), params) for i in range(n)]
        first: dict[int, float] = {}
        prefill_time = step_time = 0.0
        peak = steps = 0
        limit = n * (case.input_len + cfg.output_len) + 1000  # steps: every token one at a time, and more
        while engine.has_unfinished():
            if steps >= limit:
                raise RuntimeError(f"the engine did not finish {n} requests in {limit} steps")
            before = [s.num_computed_tokens for s in seqs]
            seconds = clock.time(engine.step)
            steps += 1
            step_time += seconds
            # a step prefilled when a prompt's computed tokens grew in it (a queued request is not prefilling)
            prefilled = any(n < s.num_prompt_tokens and s.num_computed_tokens > n for s, n in zip(seqs, before))
            prefill_time += seconds if prefilled else 0.0
            now = time.perf_counter()
            running = 0
            for s in seqs:
                if s.num_generated and s.seq_id not in first:
                    first[s.seq_id] = now - start
                running += s.num_generated > 0 and not s.is_finished
            peak = max(peak, running)
        clock.sync()
        wall = time.perf_counter() - start
        if any(s.num_generated != cfg.output_len for s in seqs):
            raise RuntimeError("a request ended before its output length (ignore_eos is set)")
    finally:
        retire(engine)
        del engine
        collect()
    ttft = np.array([first[s.seq_id] for s in seqs])
    row.update({"wall_s": wall, "output_tok_s": n * cfg.output_len / wall, "requests_s": n / wall,
                "total_tok_s": n * (case.input_len + cfg.output_len) / wall, "ttft_s": float(ttft.mean()),
                "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99)),
                "prefill_share": prefill_time / step_time if step_time else 0.0, "steps": steps,
                "peak_running": peak})
    return row
