"""Run a Hugging Face model with a reference eviction method: the end-to-end oracle for kvc.

The Hugging Face model supplies everything but attention (embeddings, RoPE, norms, MLPs, head);
attention is our own function, registered with transformers' `AttentionInterface`, which
1. at prefill runs plain causal attention over the whole prompt and records each layer's
   post-RoPE q/k/v (what eviction scores are computed from), and
2. at decode attends over a per-layer, per-KV-head cache we hold ourselves — so heads may keep
   different numbers of tokens (Ada-KV) — and appends the new tokens' K/V to it.

Prefill itself is uncompressed (as in kvpress and kvc: each layer's cache is compressed after its
prompt attention ran), so the logits of the last prompt position are those of full attention;
compression shows from the first token decoded after it. New tokens take positions T, T+1, ...
(the logical length), whatever the compressed length. In `greedy_compressed` no eviction happens
during decode: the kept prompt tokens plus every decoded token stay in the cache;
`greedy_compressed_decode` also evicts after every decoding step, per layer right after its
attention, with the rules of `decode_eviction.py` (H2O, TOVA, StreamingLLM). Batch size 1, float32.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from transformers import AttentionInterface, PreTrainedModel

from tests.references.eviction import Ranking, adakv_safeguard, gather_kv, rank

ATTN_IMPLEMENTATION = "kvc_reference"


@dataclass
class LayerPrompt:
    """One layer's prompt tensors, batch dimension dropped: q [Hq, T, D], k and v [Hkv, T, D]."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


@dataclass
class HeadCache:
    """One layer's cache held per KV head: `keys[h]`, `values[h]` are [n_h, D]."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    def lengths(self) -> list[int]:
        return [k.shape[0] for k in self.keys]


@dataclass
class CompressedRun:
    rankings: list[Ranking]  # per layer: the method's scores and count (kept = ranking.kept())
    prompt_logits: torch.Tensor  # [T, vocab], full attention
    logits: torch.Tensor  # [n, vocab] at the continuation tokens, from the compressed cache
    cache: list[HeadCache] = field(repr=False)

    @property
    def kept(self) -> list[list[torch.Tensor]]:
        """[layer][kv head] ascending prompt indices."""
        return [list(ranking.kept()) for ranking in self.rankings]


@dataclass
class _Session:
    caches: list[HeadCache] | None  # None while prefilling
    recorded: dict[int, LayerPrompt] = field(default_factory=dict)
    # decode: called per layer with the newest query [Hq, D] once its K/V joined the cache
    after_decode: Callable[[int, torch.Tensor, HeadCache], None] | None = None
    # decode: called per layer with all the step's queries [Hq, n, D] once their K/V joined the cache
    after_chunk: Callable[[int, torch.Tensor, HeadCache], None] | None = None


_active: _Session | None = None


def _attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers calls this with the post-RoPE query [1, Hq, n, D] and the new key/value
    [1, Hkv, n, D]; its own mask is ignored. Arguments in the order of transformers' sdpa
    function: wrappers such as kvpress's pass `dropout` by position."""
    if _active is None:
        raise RuntimeError(f"{ATTN_IMPLEMENTATION} attention used outside prefill() / decode()")
    if query.shape[0] != 1:
        raise ValueError("the reference model runner handles batch size 1 only")
    layer = module.layer_idx
    q, k, v = query[0].float(), key[0].float(), value[0].float()
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    if _active.caches is None:
        _active.recorded[layer] = LayerPrompt(q.clone(), k.clone(), v.clone())
        past = HeadCache([k[h, :0] for h in range(k.shape[0])], [v[h, :0] for h in range(v.shape[0])])
    else:
        past = _active.caches[layer]
    out = _attend(q, k, v, past, scale)
    if _active.caches is not None:
        past.keys[:] = [torch.cat([past.keys[h], k[h]]) for h in range(k.shape[0])]
        past.values[:] = [torch.cat([past.values[h], v[h]]) for h in range(v.shape[0])]
        if _active.after_decode is not None:
            _active.after_decode(layer, q[:, -1], past)
        if _active.after_chunk is not None:
            _active.after_chunk(layer, q, past)
    return out.transpose(0, 1)[None].to(query.dtype), None


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: HeadCache, scale: float) -> torch.Tensor:
    """New queries attend to all cached tokens of their KV head and causally to the new ones:
    [Hq, n, D]."""
    num_kv_heads, new = k.shape[0], k.shape[1]
    group = q.shape[0] // num_kv_heads
    causal = torch.ones(new, new, dtype=torch.bool).tril()
    outs = []
    for h in range(num_kv_heads):
        keys = torch.cat([past.keys[h], k[h]])
        values = torch.cat([past.values[h], v[h]])
        visible = torch.cat([torch.ones(new, past.keys[h].shape[0], dtype=torch.bool), causal], dim=1)
        logits = (q[h * group : (h + 1) * group] @ keys.T) * scale
        probs = logits.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        outs.append(probs @ values)
    return torch.cat(outs)


AttentionInterface.register(ATTN_IMPLEMENTATION, _attention)


@contextmanager
def _reference_attention(model: PreTrainedModel, session: _Session) -> Iterator[None]:
    global _active
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    _active = session
    try:
        yield
    finally:
        _active = None
        model.set_attn_implementation(previous)


def _logits(model: PreTrainedModel, ids: torch.Tensor, start: int) -> torch.Tensor:
    positions = torch.arange(start, start + ids.numel())[None]
    with torch.no_grad():
        return model(input_ids=ids.reshape(1, -1), position_ids=positions, use_cache=False).logits[0].float()


def prefill(model: PreTrainedModel, prompt_ids: torch.Tensor) -> tuple[list[LayerPrompt], torch.Tensor]:
    """Full-attention prefill: each layer's post-RoPE q/k/v and the prompt's logits [T, vocab]."""
    session = _Session(caches=None)
    with _reference_attention(model, session):
        logits = _logits(model, prompt_ids, 0)
    return [session.recorded[layer] for layer in sorted(session.recorded)], logits


def decode(
    model: PreTrainedModel, caches: list[HeadCache], token_ids: torch.Tensor, start: int
) -> torch.Tensor:
    """Logits [n, vocab] of `token_ids` at positions start.. over `caches`, which gain their K/V."""
    with _reference_attention(model, _Session(caches=caches)):
        return _logits(model, token_ids, start)


def compress(layers: list[LayerPrompt], method: str, **params: Any) -> tuple[list[Ranking], list[HeadCache]]:
    """Apply a reference method to every layer: its rankings and the compressed caches."""
    rankings, caches = [], []
    for layer, t in enumerate(layers):
        ranking = rank(method, t.q, t.k, layer=layer, num_layers=len(layers), **params)
        keys, values = gather_kv(t.k, t.v, list(ranking.kept()))
        rankings.append(ranking)
        caches.append(HeadCache(keys, values))
    return rankings, caches


def run_compressed(
    model: PreTrainedModel,
    prompt_ids: torch.Tensor,
    continuation_ids: torch.Tensor,
    method: str,
    **params: Any,
) -> CompressedRun:
    """Prefill `prompt_ids`, compress with `method`, then run `continuation_ids` from position T."""
    layers, prompt_logits = prefill(model, prompt_ids)
    rankings, caches = compress(layers, method, **params)
    logits = decode(model, caches, continuation_ids, start=prompt_ids.numel())
    return CompressedRun(rankings, prompt_logits, logits, caches)


def greedy_compressed(
    model: PreTrainedModel, prompt_ids: torch.Tensor, steps: int, method: str, **params: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens [steps] and their logits [steps, vocab], as a serving engine would produce them:
    the first token from the full-attention prefill, every later one from the compressed cache."""
    layers, prompt_logits = prefill(model, prompt_ids)
    _, caches = compress(layers, method, **params)
    step_logits = [prompt_logits[-1]]
    tokens = [int(prompt_logits[-1].argmax())]
    for step in range(1, steps):
        logits = decode(model, caches, torch.tensor([tokens[-1]]), start=prompt_ids.numel() + step - 1)[-1]
        step_logits.append(logits)
        tokens.append(int(logits.argmax()))
    return torch.tensor(tokens), torch.stack(step_logits)


def _decode_evictor(method: str, layers: list[LayerPrompt], rankings: list[Ranking], prompt_len: int,
                    params: dict[str, Any], interval: int = 1):
    """The decode-time rule of `method` (kvc's parameter names), started from the prefill's result,
    evicting every `interval` tokens of growth past the budget."""
    from tests.references import decode_eviction
    from tests.references.scores import accumulated_attention

    if method == "streamingllm":
        return decode_eviction.StreamingLLM(n_sink=params["sink"], recent=params["recent"], interval=interval)
    if method == "tova":
        return decode_eviction.TOVA(budget=params["budget"], interval=interval)
    if method == "rkv":
        return decode_eviction.RKV(prompt_queries=[t.q for t in layers], **params)
    if method == "skipkv":  # needs the tokens' text: `history` (the caller's growing token list) and `piece`
        return decode_eviction.SkipKV(prompt_queries=[t.q for t in layers], **params)
    if method in ("snapkv", "pyramidkv"):  # a decode budget (`every`): back to each layer's prefill budget
        from tests.references.eviction import kvcache_factory_budgets

        window = params["window"]
        budgets = [params["budget"]] * len(layers) if method == "snapkv" else kvcache_factory_budgets(
            prompt_len, num_layers=len(layers), budget=params["budget"], window=window, beta=params.get("beta", 20))
        return decode_eviction.SnapKV(budgets=budgets, window=window, kernel=params["kernel"],
                                      pool=params.get("pooling", "avg"), every=params["every"],
                                      prompt_queries=[t.q for t in layers])
    if method == "adakv":  # a decode budget (`every`): the layer's heads share `budget` tokens each again
        ref = _adakv_reference(params)
        return decode_eviction.AdaKV(budget=params["budget"], window=params["window"], kernel=params["kernel"],
                                     pool="avg", safeguard=adakv_safeguard(ref["budget"], ref["alpha"]),
                                     every=params["every"], prompt_queries=[t.q for t in layers])
    if method == "h2o":
        seen = [accumulated_attention(t.q, t.k).gather(1, ranking.kept()) for t, ranking in zip(layers, rankings)]
        return decode_eviction.H2O(heavy=int(params["heavy"] * prompt_len), recent=int(params["recent"] * prompt_len),
                                   seen=seen, interval=interval)
    raise ValueError(f"no decode-time reference for {method!r}")


def _prefill_params(method: str, prompt_len: int, params: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The prefill-end reference (`eviction.py`) of a decode-evicting method, from kvc's parameters."""
    if method == "streamingllm":
        return "streamingllm", {"budget": params["sink"] + params["recent"], "n_sink": params["sink"]}
    if method == "tova":
        return "tova", {"budget": params["budget"]}
    if method == "h2o":
        recent = int(params["recent"] * prompt_len)
        return "h2o", {"budget": int(params["heavy"] * prompt_len) + recent, "recent": recent}
    if method in ("rkv", "skipkv"):  # no prefill-end keep: every prompt token stays
        return "streamingllm", {"budget": prompt_len, "n_sink": 0}
    if method in ("snapkv", "pyramidkv"):
        shared = {"budget": params["budget"], "window": params["window"], "kernel": params["kernel"],
                  "pool": params.get("pooling", "avg")}
        return ("snapkv", shared) if method == "snapkv" else ("pyramidkv_factory", {**shared, "beta": params["beta"]})
    if method == "adakv":
        return "adakv", _adakv_reference(params)
    raise ValueError(f"no decode-time reference for {method!r}")


def _adakv_reference(params: dict[str, Any]) -> dict[str, Any]:
    """`rank_adakv`'s parameters for kvc's adakv ones: kvc's `alpha` counts the safeguard outside the window
    (floor(alpha * (budget - window)) tokens), the reference's (kvpress's) counts window tokens first."""
    budget, window = params["budget"], params["window"]
    safeguard = window + math.floor(params.get("alpha", 0.2) * (budget - window))
    return {"budget": budget, "window": window, "kernel": params["kernel"], "pool": "avg",
            "alpha": (safeguard + 0.5) / budget}


def greedy_compressed_decode(
    model: PreTrainedModel, prompt_ids: torch.Tensor, steps: int, method: str, interval: int = 1, **params: Any
) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """Like `greedy_compressed`, with the method's decode-time eviction after every step (after
    `interval` tokens of growth past the budget, with `interval` > 1).

    `method` is one of streamingllm (sink, recent), h2o (heavy, recent: fractions of the prompt),
    tova (budget), rkv (budget, window, kernel, mix, threshold, every), skipkv (budget, window, kernel,
    threshold, every, and `piece`: a token's text), and snapkv / pyramidkv with a decode budget (budget,
    window, kernel, pooling, every; pyramidkv's beta), with kvc's parameter names.
    Returns the greedy tokens [steps], their logits [steps, vocab], and per decoding step the cache
    length of every layer after eviction."""
    prompt_len = prompt_ids.numel()
    layers, prompt_logits = prefill(model, prompt_ids)
    ref_method, ref_params = _prefill_params(method, prompt_len, params)
    rankings, caches = compress(layers, ref_method, **ref_params)
    history = prompt_ids.tolist()  # the tokens so far (SkipKV's sentences read their text)
    if method == "skipkv":
        params = {**params, "history": history}
    evictor = _decode_evictor(method, layers, rankings, prompt_len, params, interval)
    step_logits = [prompt_logits[-1]]
    tokens = [int(prompt_logits[-1].argmax())]
    history.append(tokens[-1])
    lengths = []
    for step in range(1, steps):
        session = _Session(caches=caches, after_decode=evictor.step)
        with _reference_attention(model, session):
            logits = _logits(model, torch.tensor([tokens[-1]]), prompt_len + step - 1)[-1]
        lengths.append([max(cache.lengths()) for cache in caches])  # a layer's slots: its longest head
        step_logits.append(logits)
        tokens.append(int(logits.argmax()))
        history.append(tokens[-1])
    return torch.tensor(tokens), torch.stack(step_logits), lengths
