"""The memory floor of a decode step (`kvc bench throughput`'s decode windows on a GPU): the bytes one step
of the batch must read, over the copy bandwidth measured in the same run (bandwidth.py), as every
bandwidth figure in docs/benchmarks.md is counted. `vs_floor` = the step's time over it.

The bytes a step reads:
- weights: every parameter once, except the embedding table, of which only the batch's rows are read
  (unless it is also the output projection, `DecoderLM.compute_logits`);
- routed experts (`RoutedExperts`): a step reads the experts its tokens choose. Counted as the
  expectation under uniform routing: of E experts, with top-k choices for each of B tokens,
  E (1 - (1 - k / E)^B) are chosen. Every expert's bytes are reported too (`expert_bytes_all`);
- the KV cache: the bytes every row holds, each layer's tokens at its storage class's bytes per token
  (runtime/kv/spec.py), averaged over the window. A sparse method reads fewer of them, so its floor is
  counted high.
"""

from __future__ import annotations

from torch import nn

from kvc.runtime.models.experts import RoutedExperts


def weight_bytes(model: nn.Module, batch: int) -> dict:
    """{"dense": bytes every step reads whole, "experts_all": the routed experts' bytes, "experts_read": the
    expected bytes of the experts `batch` tokens choose} of `model`."""
    experts = {id(m): m for m in model.modules() if isinstance(m, RoutedExperts)}
    top_k = {id(getattr(m, "experts")): int(m.top_k) for m in model.modules()
             if isinstance(getattr(m, "experts", None), RoutedExperts) and hasattr(m, "top_k")}
    inside = {id(p) for m in experts.values() for p in m.parameters()}
    table = getattr(model, "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    tied = head is None or (isinstance(table, nn.Embedding) and head.weight.data_ptr() == table.weight.data_ptr())
    rows_only = table.weight if isinstance(table, nn.Embedding) and not tied else None
    dense = 0
    seen: set[int] = set()
    for p in model.parameters():
        if p.data_ptr() in seen or id(p) in inside:
            continue
        seen.add(p.data_ptr())
        nbytes = p.numel() * p.element_size()
        if rows_only is not None and p is rows_only:
            nbytes = min(batch, p.shape[0]) * p.shape[1] * p.element_size()
        dense += nbytes
    every, read = 0, 0.0
    for key, m in experts.items():
        nbytes = sum(p.numel() * p.element_size() for p in m.parameters())
        every += nbytes
        k, n = top_k.get(key, m.num_experts), m.num_experts
        read += nbytes * (1.0 - (1.0 - min(k, n) / n) ** batch)
    return {"dense": dense, "experts_all": every, "experts_read": read}


def kv_bytes(engine, seqs: list) -> int:
    """Bytes the rows of `seqs` hold now: each layer's tokens at its storage class's bytes per token."""
    attention = engine.attention
    per_token = []
    for layer in range(engine.spec.num_layers):
        store = attention.store_of(layer)
        per_token.append(store.spec.bytes_per_token(store.num_kv_heads))
    return sum(n * b for seq in seqs for n, b in zip(seq.kv_lens, per_token))


def step_floor(model: nn.Module, batch: int, kv: float, copy_gbps: float, step_ms: float) -> dict:
    """The floor of one step of `batch` rows holding `kv` bytes (module docstring), against `step_ms`."""
    weights = weight_bytes(model, batch)
    read = weights["dense"] + weights["experts_read"] + kv
    floor_ms = read / (copy_gbps * 1e6)
    return {"floor_ms": floor_ms, "vs_floor": step_ms / floor_ms, "copy_GBps": copy_gbps, "kv_bytes": int(kv),
            "weight_bytes": weights["dense"], "expert_bytes_read": int(weights["experts_read"]),
            "expert_bytes_all": weights["experts_all"]}
