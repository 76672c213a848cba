"""SnapKV across the turns of a chat session, by hand: the oracle of the chain cache for SnapKV.

Turn 1 is SnapKV as the paper runs it (`model_forward.greedy_compressed`): full-attention prefill,
the prompt compressed per layer, then greedy decoding that appends every decoded token. A later
turn continues on that compressed state, as the chain cache defines it (docs/design.md, "Chain
cache"): its new suffix (the conversation past the tokens whose K/V are stored) runs at the
logical positions that follow, attending to the stored K/V and causally to itself; then SnapKV
compresses each layer's whole stored cache again, right after that layer's attention, with the
suffix's last `window` queries as the observation window (`eviction.rank_snapkv` over the stored
keys: the window keys are the newest, as in a prompt). Nothing here comes from kvc's engine.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from tests.references.eviction import gather_kv, rank_snapkv
from tests.references.model_forward import HeadCache, _logits, _reference_attention, _Session, compress, prefill


def _compress_stored(cache: HeadCache, q: torch.Tensor, params: dict) -> None:
    """SnapKV over one layer's stored cache, the window queries being the last of `q` [Hq, n, D]."""
    keys, values = torch.stack(cache.keys), torch.stack(cache.values)  # [Hkv, T, D]: SnapKV keeps equal counts
    length, window = keys.shape[1], params["window"]
    if q.shape[1] < window and length > params["budget"]:
        raise ValueError(f"a suffix of {q.shape[1]} tokens is shorter than the {window}-query window")
    queries = torch.zeros(q.shape[0], length, q.shape[2])
    queries[:, length - q.shape[1]:] = q  # only the last `window` rows are read
    kept = rank_snapkv(queries, keys, **params).kept()
    cache.keys[:], cache.values[:] = gather_kv(keys, values, list(kept))


def _decode(model: PreTrainedModel, caches: list[HeadCache], first: int, start: int, steps: int) -> list[int]:
    """Greedy tokens: `first`, then steps - 1 more, each fed at the next logical position."""
    tokens = [first]
    for step in range(1, steps):
        with _reference_attention(model, _Session(caches=caches)):
            logits = _logits(model, torch.tensor([tokens[-1]]), start + step - 1)[-1]
        tokens.append(int(logits.argmax()))
    return tokens


def snapkv_session(model: PreTrainedModel, prompts: list[list[int]], steps: list[int], **params) -> list[list[int]]:
    """Greedy tokens of each turn; `prompts[k]` is the whole conversation at turn k (it extends the
    tokens stored after turn k - 1); `params`: budget, window, kernel, pool."""
    layers, logits = prefill(model, torch.tensor(prompts[0]))
    _, caches = compress(layers, "snapkv", **params)
    out = [_decode(model, caches, int(logits[-1].argmax()), len(prompts[0]), steps[0])]
    stored = prompts[0] + out[0][:-1]  # the last sampled token is never fed
    for prompt, n in zip(prompts[1:], steps[1:]):
        if prompt[: len(stored)] != stored:
            raise ValueError("a turn's prompt must extend the stored conversation")
        suffix = torch.tensor(prompt[len(stored):])
        session = _Session(caches=caches, after_chunk=lambda layer, q, cache: _compress_stored(cache, q, params))
        with _reference_attention(model, session):
            logits = _logits(model, suffix, len(stored))
        out.append(_decode(model, caches, int(logits[-1].argmax()), len(prompt), n))
        stored = prompt + out[-1][:-1]
    return out
