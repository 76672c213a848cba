"""`kvc bench throughput --mix`: the methods of a run together in one engine, one batch (runtime/lanes.py).

At each input length, after every method's own decode window, one more engine loads all of them
(the first is the default, the others by name with the same parameters) and times a decode window
over one batch in which each method holds an equal share of the rows: per method one real request
prefilled (plus its `sources`), cloned up to its share, its clones' layers mixed among its own
sources only (their pages are of its storage). The batch is the smallest the methods' plans hold
(`cap_batches` sets every method's own window to it), so the mixed row and the homogeneous rows
step the same number of sequences; `vs_slowest` is the mixed step time over the slowest homogeneous
one (the issue's bar: at most 1.1). Row mode "mixed_window".
"""

from __future__ import annotations

import time
from dataclasses import replace
from functools import partial

from kvc.runtime.bench.sources import mix_layers, prefill_sources
from kvc.runtime.bench.steps import Clock, collect, first_tokens, make_engine, prompt, retire, warm_up, window
from kvc.runtime.sampling_params import SamplingParams


def cap_batches(cases: list) -> list:
    """Every case planned at the smallest batch of the cases of its input length (the mixed window's)."""
    least: dict[int, int] = {}
    for case in cases:
        least[case.input_len] = min(least.get(case.input_len, case.plan.batch), case.plan.batch)
    return [replace(case, plan=replace(case.plan, batch=least[case.input_len])) for case in cases]


def mixed_row(cfg, cases: list, rows: list[dict]) -> dict:
    """The mixed decode window of `cases` (one input length, one per method); `rows`: their own windows."""
    from kvc.runtime.methods import resolve_method

    first = cases[0]
    batch = first.plan.batch
    names = [case.method for case in cases]
    row = {"method": "+".join(names), "params": {c.method: c.resolved for c in cases}, "input_len": first.input_len,
           "output_len": cfg.output_len, "mode": "mixed_window", "batch": batch}
    if batch < len(cases):
        row["error"] = f"a batch of {batch} cannot hold a row of each of {len(cases)} methods"
        return row
    shares = [batch // len(cases) + (i < batch % len(cases)) for i in range(len(cases))]
    phases: dict[str, float] = {}
    start = time.perf_counter()
    method = resolve_method(first.method, first.params or None)
    engine = make_engine(cfg, first.model, method, first.params, first.input_len, batch,
                         methods=names[1:], methods_params={c.method: c.params for c in cases[1:]})
    try:
        clock = Clock(engine.device)
        phases["load_s"] = time.perf_counter() - start
        phases["warmup_s"] = clock.time(partial(warm_up, engine, cfg, first.input_len))
        seqs = []
        for i, (case, share) in enumerate(zip(cases, shares)):
            params = SamplingParams(max_tokens=cfg.output_len, temperature=cfg.temperature, ignore_eos=True,
                                    method=case.method)
            seq = engine.add_request(prompt(engine.spec.vocab_size, first.input_len, cfg.seed + 1000 * i), params)
            first_tokens(engine, [seq], clock, limit=first.input_len + 1)
            count = min(cfg.sources, share)
            sources = [seq, *prefill_sources(engine, params, first.input_len, count - 1, cfg.seed + 1000 * i, clock)]
            clones = engine.clone_sequence(seq, share - count)
            mix_layers(engine, clones, sources, cfg.seed + i)
            seqs += [*sources, *clones]
        phases["warmup_steps_s"] = window(engine, seqs, cfg.warmup, clock)
        seconds = window(engine, seqs, cfg.steps, clock)
        phases["window_s"] = seconds
        row.update({"decode_tok_s": batch * cfg.steps / seconds, "step_ms": 1e3 * seconds / cfg.steps,
                    "shares": dict(zip(names, shares)), "groups": len(engine.runner.groups)})
    finally:
        retire(engine)
        del engine
        collect()
    own = [r for r in rows if r.get("mode") == "decode_window" and r["input_len"] == first.input_len
           and r["method"] in names and r.get("step_ms")]
    if len(own) == len(names):
        slowest = max(own, key=lambda r: r["step_ms"])
        row["vs_slowest"] = row["step_ms"] / slowest["step_ms"]
        row["slowest"] = slowest["method"]
    row["phases"] = phases
    return row
