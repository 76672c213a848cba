"""RetroInfer (Chen et al. 2025, "RetroInfer: A Vector-Storage Approach for Scalable Long-Context LLM
Inference"), its wave index written by hand from the paper's algorithm (no kvc code): the oracle of
methods/retroinfer.kvm.

Per layer and KV head, the keys between the first `sink` and the last `local` tokens of the prompt
are clustered by k-means (Lloyd, L2 distance, `iterations` steps, the centroids starting at evenly
spaced keys) segment by segment: segments of `segment` tokens from the first indexed slot, the last
one partial; later, each time `segment` tokens lie between the index and the newest `local`
tokens, they become one more segment. A segment of n keys has ceil(n / cluster_size) clusters.
In a decode step the step's query scores every cluster by the largest q.centroid of the KV head's
query heads; in score order (ties: the older cluster) the best ceil(retrieved * context /
cluster_size) clusters are read exactly (the paper's nprobe: a fraction of the clusters), the next
ceil((computed - retrieved) * context / cluster_size) estimated: an estimated cluster of n tokens
enters the softmax as one key (its centroid) weighted by n, with its mean value. The first `sink`
tokens and everything past the index (the newest `local` prompt tokens and the generated ones) are
read exactly. Prefill is dense.

`generate` runs a Hugging Face model with that attention (transformers' `AttentionInterface`) over
a cache held per layer, the index rebuilt from the cache in every decode step (the engine keeps it
and grows it; the segments are the same).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel

NAME = "kvc_retroinfer_reference"


def kmeans(x: torch.Tensor, k: int, iterations: int) -> list[int]:
    """Lloyd's k-means of x [n, D]: the cluster of each vector."""
    n = x.shape[0]
    k = min(k, n)
    centroids = [x[(i * n) // k].clone() for i in range(k)]
    assign: list[int] = []
    for step in range(iterations + 1):
        assign = []
        for i in range(n):
            dists = [float(((x[i] - c) ** 2).sum()) for c in centroids]
            assign.append(min(range(k), key=lambda j: (dists[j], j)))
        if step == iterations:
            break
        for j in range(k):
            members = [x[i] for i in range(n) if assign[i] == j]
            if members:
                centroids[j] = torch.stack(members).mean(0)
    return assign


@dataclass
class Cluster:
    slots: list[int]
    centroid: torch.Tensor  # [D]: the mean key
    value_sum: torch.Tensor  # [D]


def segments(params: dict, prompt: int, length: int) -> tuple[int, int, list[tuple[int, int]]]:
    """(start, end, [segment ranges]): the indexed slots [start, end) of a row whose prefill stored
    `prompt` tokens and which holds `length` (the step's own token included) in segments."""
    size = params["segment"]
    start = min(params["sink"], prompt)
    end = max(start, prompt - params["local"])
    out = [(lo, min(end, lo + size)) for lo in range(start, end, size)]
    while end + size <= min(length - params["local"], length - 1):
        out.append((end, end + size))
        end += size
    return start, end, out


def index(keys: torch.Tensor, values: torch.Tensor, params: dict, prompt: int, length: int):
    """Per KV head, its clusters (in segment order, then by k-means cluster number; empty ones left
    out), and the indexed range [start, end)."""
    start, end, parts = segments(params, prompt, length)
    heads = []
    for h in range(keys.shape[0]):
        clusters = []
        for lo, hi in parts:
            k = math.ceil((hi - lo) / params["cluster_size"])
            assign = kmeans(keys[h, lo:hi].float(), k, params.get("iterations", 10))
            for j in range(min(k, hi - lo)):
                slots = [lo + i for i in range(hi - lo) if assign[i] == j]
                if slots:
                    clusters.append(Cluster(slots, keys[h, slots].float().mean(0), values[h, slots].float().sum(0)))
        heads.append(clusters)
    return heads, start, end


def plan(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, params: dict, prompt: int):
    """A decode step's reads per KV head: (exact slots, estimated clusters), from the step query q
    [Hq, D] and the stored keys/values [Hkv, n, D] (the step's own last)."""
    length = keys.shape[1]
    heads, start, end = index(keys, values, params, prompt, length)
    group = q.shape[0] // keys.shape[0]
    size = params["cluster_size"]
    n_read = math.ceil(length * params["retrieved"] / size)
    n_estimated = math.ceil(length * (params["computed"] - params["retrieved"]) / size)
    out = []
    for h, clusters in enumerate(heads):
        scores = [max(float(q[g].float() @ c.centroid) for g in range(h * group, (h + 1) * group)) for c in clusters]
        order = sorted(range(len(clusters)), key=lambda j: (-scores[j], j))
        exact = set(range(start)) | set(range(end, length))
        for j in order[:n_read]:
            exact |= set(clusters[j].slots)
        estimated = [clusters[j] for j in order[n_read:n_read + n_estimated]]
        out.append((sorted(exact), estimated))
    return out


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, reads, scale: float) -> torch.Tensor:
    """The step's attention output [Hq, D]: a softmax over each head's exact slots and its estimated
    clusters (logit q.centroid * scale + log(size), value the mean value)."""
    group = q.shape[0] // keys.shape[0]
    out = []
    for g in range(q.shape[0]):
        exact, estimated = reads[g // group]
        h = g // group
        logits = [keys[h, exact].float() @ q[g].float() * scale]
        vals = [values[h, exact].float()]
        if estimated:
            cents = torch.stack([c.centroid for c in estimated])
            sizes = torch.tensor([float(len(c.slots)) for c in estimated])
            logits.append(cents @ q[g].float() * scale + sizes.log())
            vals.append(torch.stack([c.value_sum / len(c.slots) for c in estimated]))
        probs = torch.cat(logits).softmax(-1)
        out.append(probs @ torch.cat(vals))
    return torch.stack(out)


@dataclass
class Session:
    params: dict[str, Any]
    keys: list[torch.Tensor] = field(default_factory=list)  # per layer [Hkv, n, D]
    values: list[torch.Tensor] = field(default_factory=list)
    prompt: int = 0
    decoding: bool = False
    estimated: int = 0  # clusters estimated so far (the tests check that some were)

    @property
    def length(self) -> int:
        return 0 if not self.keys else self.keys[0].shape[1]

    def copy(self) -> Session:
        return copy.deepcopy(self)

    def truncate(self, n: int) -> Session:
        """The first n tokens of the cache (a prefix-cache hit)."""
        out = self.copy()
        out.keys = [k[:, :n] for k in out.keys]
        out.values = [v[:, :n] for v in out.values]
        return out


_active: Session | None = None


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, dropout: float = 0.0, scaling: float | None = None, **kwargs: Any):
    s = _active
    layer = module.layer_idx
    q, k, v = query[0].float(), key[0].float(), value[0].float()  # [Hq, c, D], [Hkv, c, D]
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    while len(s.keys) <= layer:
        s.keys.append(k[:, :0])
        s.values.append(v[:, :0])
    s.keys[layer] = torch.cat([s.keys[layer], k], dim=1)
    s.values[layer] = torch.cat([s.values[layer], v], dim=1)
    keys, values = s.keys[layer], s.values[layer]
    if s.decoding:
        reads = plan(q[:, -1], keys, values, s.params, s.prompt)
        s.estimated += sum(len(e) for _, e in reads)
        return attend(q[:, -1], keys, values, reads, scale)[None, None].to(query.dtype), None
    kv_heads, n, new = keys.shape[0], keys.shape[1], k.shape[1]
    group = q.shape[0] // kv_heads
    seen = torch.arange(n)[None, :] <= torch.arange(n - new, n)[:, None]  # causal [c, n]
    outs = []
    for h in range(kv_heads):
        logits = q[h * group:(h + 1) * group] @ keys[h].T * scale  # [G, c, n]
        outs.append(logits.masked_fill(~seen[None], float("-inf")).softmax(-1) @ values[h])
    return torch.cat(outs).transpose(0, 1)[None].to(query.dtype), None


AttentionInterface.register(NAME, _attention)


def _forward(model: PreTrainedModel, session: Session, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), vocab] of `ids` at positions session.length.., appended to the session."""
    global _active
    start = session.length
    previous = model.config._attn_implementation
    model.set_attn_implementation(NAME)
    _active = session
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids]), position_ids=torch.arange(start, start + len(ids))[None],
                        use_cache=False).logits[0].float()
    finally:
        _active = None
        model.set_attn_implementation(previous)
    return out


def generate(model: PreTrainedModel, session: Session, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy: prefill `prompt` onto the session (one chunk, dense), then `steps - 1` decode steps;
    the tokens and their logits [steps, vocab]."""
    session.decoding = False
    logits = [_forward(model, session, prompt)[-1]]
    session.prompt = session.length
    tokens = [int(logits[-1].argmax())]
    session.decoding = True
    for _ in range(steps - 1):
        logits.append(_forward(model, session, [tokens[-1]])[-1])
        tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits)
