"""Run prompts through the served engine and record what it decided, for the parity tests.

The engine is built as a user builds it (`LLM(model, method=..., method_params=...)`); nothing in
`runtime/` knows it is observed. Two spies, installed for the run only:
- kept tokens: the method object's `prefill_end` is wrapped on the instance, and the `KeepPlan`
  it returns is recorded per (sequence, layer) as one index tensor per KV head: physical token
  indices, which at prefill end are the prompt's positions (the whole prompt is resident); a plan
  with per-head `lengths` (Ada-KV) gives head h its first `lengths[h]` indices. A `None` plan
  (keep everything) is recorded as every index;
- logits: the runner's `sample` is wrapped and the logits rows it is given are recorded per
  request. Each request gets its own `SamplingParams` object, which is how a row is matched to
  its request (the sampler sees the batch's params in row order).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import kvc.runtime.model_runner as model_runner
from kvc.runtime.llm import LLM
from kvc.runtime.method_api import PrefillView
from kvc.runtime.sampling_params import SamplingParams


@dataclass
class ServedRequest:
    prompt: list[int]
    tokens: list[int]  # greedy tokens generated
    logits: torch.Tensor  # [steps, vocab]: row 0 from the prefill, row i from decoding tokens[i-1]
    kept: list[list[torch.Tensor]] = field(repr=False)  # [layer][kv head]: ascending prompt indices

    def kept_heads(self, layer: int) -> list[torch.Tensor]:
        return list(self.kept[layer])


def make_llm(model_dir: Path, method: str, params: dict[str, Any] | None, *, page_size: int,
             chunk: int | None) -> LLM:
    """float32 CPU engine, torch attention; `chunk` None: every prompt prefills in one step."""
    chunking = {"max_num_batched_tokens": 64, "max_prefill_chunk": chunk} if chunk else {
        "max_num_batched_tokens": 4096}
    return LLM(str(model_dir), method=method, method_params=params, device="cpu", dtype="float32",
               page_size=page_size, attention_backend="torch", **chunking)


def serve(llm: LLM, prompts: list[list[int]], steps: int) -> list[ServedRequest]:
    """Greedy `steps` tokens for every prompt, batched; the kept tokens and logits of each."""
    engine = llm.engine
    method = engine.method
    kept: dict[tuple[int, int], list[torch.Tensor]] = {}
    logits: dict[int, list[torch.Tensor]] = {}  # id(params) -> rows
    prefill_end, sample = method.prefill_end, model_runner.sample

    def spy_prefill_end(layer: int, view: PrefillView):
        plan = prefill_end(layer, view)
        if (view.seq_id, layer) in kept:
            raise AssertionError(f"prefill_end ran twice for sequence {view.seq_id} layer {layer}")
        heads = view.k.shape[1]
        if plan is None:
            kept[view.seq_id, layer] = [torch.arange(view.cache.length) for _ in range(heads)]
        else:
            indices = plan.indices.detach().cpu()
            counts = [indices.shape[1]] * heads if plan.lengths is None else plan.lengths.tolist()
            kept[view.seq_id, layer] = [indices[h, : counts[h]].clone() for h in range(heads)]
        return plan

    def spy_sample(rows: torch.Tensor, params, *args, **kwargs):
        for row, p in zip(rows, params):
            logits.setdefault(id(p), []).append(row.detach().float().cpu().clone())
        return sample(rows, params, *args, **kwargs)

    params = [SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True) for _ in prompts]
    own = vars(method).get("prefill_end")  # an instance attribute to put back, if any
    method.prefill_end = spy_prefill_end
    model_runner.sample = spy_sample
    try:
        seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        while engine.has_unfinished():
            engine.step()
    finally:
        if own is None:
            del method.prefill_end  # back to the class's method
        else:
            method.prefill_end = own
        model_runner.sample = sample
    assert engine.pool.num_free == engine.pool.num_pages
    if any(len(logits.get(id(sp), [])) != steps for sp in params):
        raise AssertionError("the logits spy missed sampled rows: does the runner still call model_runner.sample?")
    layers = engine.spec.num_layers
    return [
        ServedRequest(prompt, list(seq.generated_ids), torch.stack(logits[id(sp)]),
                      [kept[seq.seq_id, layer] for layer in range(layers)])
        for prompt, seq, sp in zip(prompts, seqs, params)
    ]
