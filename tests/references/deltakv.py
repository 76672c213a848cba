"""DeltaKV (inference), written by hand from its definition (docs/design.md, "DeltaKV": the paper's
Sparse-vLLM cache manager with kvc's choices) with no kvc code: the oracle of methods/deltakv.kvm.

A token's vector is x = [k_pre | v] over all KV heads, k_pre its key before RoPE (the model's key
rotated back by its position). Per non-full layer the first `sink` tokens stay raw; once the raw
buffer after them reaches 2 * recent tokens, all but recent..2*recent-1 of it is compressed in whole
multiples of `recent`. In a compressed block every stride-th position is a center and keeps its raw
x; any other token t keeps code_t = down(x_t) - down(ref_t), ref_t the mean raw x of its `neighbours`
nearest centers (squared L2 over x; centers before the block, or in it at positions <= t), and is
read back as ref_t + up(code_t), its key rotated to position t again.

Decode step, layer l: a full layer (or a layer before the first full layer) attends to every token;
a full layer also chooses the `selected` tokens with the highest max-over-query-heads logit; any
later non-full layer attends to the sinks, the latest full layer's choice and the raw buffer.
Prefill is dense: a chunk reads its own tokens as computed and earlier ones as stored. The
compression runs after every prefill chunk and every decode step.

`generate` runs a Hugging Face model with that attention (transformers' `AttentionInterface`) over
a cache this module holds per layer (float32 keys before RoPE and values [Hkv, n, D]); a compressed
non-center's raw row is overwritten with NaN, so nothing can read it.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel

from tests.references import harness
from tests.references.harness import rope

NAME = "kvc_deltakv_reference"
TENSORS = ("k_down", "v_down", "k_up", "v_up", "k_bias", "v_bias")


@dataclass(frozen=True)
class Params:
    sink: int = 8
    recent: int = 128
    stride: int = 8
    neighbours: int = 4
    selected: int = 2048
    full_layers: tuple[int, ...] = (0, 1, 2, 8, 18)

    def __post_init__(self) -> None:
        if self.sink < 0 or self.recent < 1 or self.stride < 1 or self.neighbours < 1 or self.selected < 1:
            raise ValueError(f"DeltaKV params out of range: {self}")


@dataclass
class Compressor:
    """Per layer: k_down, v_down, k_up, v_up [layers, Hkv, D, C]; k_bias, v_bias [layers, Hkv, D]."""

    k_down: torch.Tensor
    v_down: torch.Tensor
    k_up: torch.Tensor
    v_up: torch.Tensor
    k_bias: torch.Tensor
    v_bias: torch.Tensor

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor]) -> Compressor:
        missing = [name for name in TENSORS if name not in tensors]
        if missing:
            raise ValueError(f"DeltaKV compressor lacks {', '.join(missing)} (has {', '.join(sorted(tensors))})")
        return cls(**{name: tensors[name].float() for name in TENSORS})

    @classmethod
    def load(cls, path: str | Path) -> Compressor:
        """A file in this layout, or as `kvc calibrate deltakv` writes it (methods/deltakv.kvm's inputs:
        `down`, `up` [layers, Hkv, 2 D, C], each head's key rows then its value rows; `bias` [layers,
        Hkv, 2 D])."""
        from safetensors.torch import load_file

        tensors = load_file(str(path))
        if {"down", "up", "bias"} <= set(tensors):
            dim = tensors["bias"].shape[-1] // 2
            tensors = {f"{which}_{part}": tensors[part][:, :, i * dim:(i + 1) * dim] for part in ("down", "up", "bias")
                       for i, which in enumerate("kv")}
        return cls.from_tensors(tensors)

    def down(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """x [n, 2 Hkv D] -> [n, C]: sum_h k_pre[h] @ k_down[h] + sum_h v[h] @ v_down[h]."""
        k, v = split(x, self.k_down.shape[1])
        return (torch.einsum("nhd,hdc->nc", k, self.k_down[layer])
                + torch.einsum("nhd,hdc->nc", v, self.v_down[layer]))

    def up(self, layer: int, code: torch.Tensor) -> torch.Tensor:
        """code [n, C] -> [n, 2 Hkv D]: per head, k = code @ k_up[h]^T + k_bias[h] (v alike)."""
        k = torch.einsum("nc,hdc->nhd", code, self.k_up[layer]) + self.k_bias[layer]
        v = torch.einsum("nc,hdc->nhd", code, self.v_up[layer]) + self.v_bias[layer]
        return join(k, v)


def identity_compressor(num_layers: int, num_kv_heads: int, head_dim: int) -> Compressor:
    """C = 2 Hkv D, down = up = the coordinate picks of x: up(down(x) - down(ref)) + ref == x."""
    width = num_kv_heads * head_dim
    pick = torch.eye(2 * width).reshape(2, num_kv_heads, head_dim, 2 * width)
    k, v = (pick[i].expand(num_layers, -1, -1, -1).clone() for i in range(2))
    zero = torch.zeros(num_layers, num_kv_heads, head_dim)
    return Compressor(k_down=k, v_down=v, k_up=k.clone(), v_up=v.clone(), k_bias=zero, v_bias=zero.clone())


def join(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """k, v [n, Hkv, D] -> x [n, 2 Hkv D] = [k heads 0.. | v heads 0..]."""
    return torch.cat([k.reshape(k.shape[0], -1), v.reshape(v.shape[0], -1)], dim=1)


def split(x: torch.Tensor, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, 2 Hkv D] -> k, v [n, Hkv, D]."""
    k, v = x.chunk(2, dim=1)
    return k.reshape(x.shape[0], kv_heads, -1), v.reshape(x.shape[0], kv_heads, -1)


def nearest(x: torch.Tensor, block: torch.Tensor, centers: torch.Tensor, count: int) -> torch.Tensor:
    """[len(block), count] the positions of each block token's `count` nearest centers (squared L2
    over x [n, 2 Hkv D], in float64) among those at positions <= its own, nearest first, ties to the
    earlier position; -1 where it has fewer. `centers` ascending."""
    # L2 from the coordinates' differences (not |a|^2 + |b|^2 - 2ab): ranks as its square does
    d = torch.cdist(x[block].double(), x[centers].double(), compute_mode="donot_use_mm_for_euclid_dist")
    d = d.masked_fill(centers[None, :] > block[:, None], math.inf)
    order = d.sort(dim=1, stable=True).indices[:, :count]
    picked = centers[order]
    return picked.masked_fill(d.gather(1, order).isinf(), -1)


def reference(x: torch.Tensor, neighbours: torch.Tensor) -> torch.Tensor:
    """ref [m, 2 Hkv D]: the mean raw x of each row's neighbour positions ([m, K], -1 for none)."""
    valid = (neighbours >= 0).float()[..., None]
    return (x[neighbours.clamp(min=0)] * valid).sum(1) / valid.sum(1)


@dataclass
class Session:
    """One sequence's cache, what it chose and read, and its compression schedule."""

    params: Params
    compressor: Compressor
    inv_freq: torch.Tensor
    num_layers: int
    keys: list[torch.Tensor] = field(default_factory=list)  # per layer [Hkv, n, D] before RoPE; NaN rows dropped
    values: list[torch.Tensor] = field(default_factory=list)
    codes: list[torch.Tensor] = field(default_factory=list)  # per layer [compressed, C]
    neighbours: list[torch.Tensor] = field(default_factory=list)  # per layer [compressed, neighbours], -1 pad
    compressed: list[int] = field(default_factory=list)  # per layer: positions [sink, sink + compressed)
    decoding: bool = False
    chosen: torch.Tensor | None = None  # the latest full layer's choice in this step
    choices: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (layer, chosen) of every step
    reads: list[dict[int, torch.Tensor]] = field(default_factory=list)  # per decode step: layer -> positions read
    schedule: list[tuple[int, list[int]]] = field(default_factory=list)  # (length, compressed per layer) per forward

    @property
    def full_layers(self) -> list[int]:
        return sorted(x for x in self.params.full_layers if x < self.num_layers)

    def is_full(self, layer: int) -> bool:
        return layer in self.full_layers

    def reads_all(self, layer: int) -> bool:
        full = self.full_layers
        return not full or layer in full or layer < full[0]

    def length(self, layer: int = 0) -> int:
        return 0 if len(self.keys) <= layer else self.keys[layer].shape[1]

    def is_center(self, position: torch.Tensor) -> torch.Tensor:
        sink, stride = self.params.sink, self.params.stride
        return (position < sink) | ((position - sink) % stride == 0)

    def raw(self, layer: int) -> torch.Tensor:
        """x [n, 2 Hkv D] as stored (NaN rows: compressed non-centers)."""
        return join(self.keys[layer].transpose(0, 1), self.values[layer].transpose(0, 1))

    def store(self, layer: int, k_pre: torch.Tensor, v: torch.Tensor) -> None:
        while len(self.keys) <= layer:
            self.keys.append(k_pre[:, :0])
            self.values.append(v[:, :0])
            self.codes.append(torch.zeros(0, self.compressor.k_down.shape[-1]))
            self.neighbours.append(torch.zeros(0, self.params.neighbours, dtype=torch.long))
            self.compressed.append(0)
        self.keys[layer] = torch.cat([self.keys[layer], k_pre], dim=1)
        self.values[layer] = torch.cat([self.values[layer], v], dim=1)

    def reconstruct(self, layer: int) -> torch.Tensor:
        """x^ [compressed, 2 Hkv D] of the compressed positions: ref_t + up(code_t) (centers too; the
        caller reads a center's raw x)."""
        ref = reference(self.raw(layer), self.neighbours[layer])
        return ref + self.compressor.up(layer, self.codes[layer])

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's keys (before RoPE) and values [Hkv, n, D] as the cache yields them."""
        x = self.raw(layer)
        start, count = self.params.sink, self.compressed[layer]
        if count:
            positions = torch.arange(start, start + count)
            rebuilt = ~self.is_center(positions)
            x[positions[rebuilt]] = self.reconstruct(layer)[rebuilt]
        k, v = split(x, self.keys[layer].shape[0])
        return k.transpose(0, 1), v.transpose(0, 1)

    def compress(self, layer: int) -> None:
        """Compress the buffer down to recent..2*recent-1 raw tokens, in multiples of `recent`."""
        p, n = self.params, self.length(layer)
        start = p.sink + self.compressed[layer]
        buffer = n - start
        if buffer < 2 * p.recent:
            return
        block = torch.arange(start, start + ((buffer - p.recent) // p.recent) * p.recent)
        x = self.raw(layer)
        everything = torch.arange(block[-1] + 1)
        centers = everything[self.is_center(everything)]
        nb = nearest(x, block, centers, p.neighbours)
        ref = reference(x, nb)
        code = self.compressor.down(layer, x[block]) - self.compressor.down(layer, ref)
        self.codes[layer] = torch.cat([self.codes[layer], code])
        self.neighbours[layer] = torch.cat([self.neighbours[layer], nb])
        self.compressed[layer] += len(block)
        dropped = block[~self.is_center(block)]
        self.keys[layer][:, dropped] = math.nan
        self.values[layer][:, dropped] = math.nan

    def end_forward(self) -> None:
        for layer in range(self.num_layers):
            if not self.is_full(layer):
                self.compress(layer)
        self.schedule.append((self.length(), list(self.compressed)))


def choose(q: torch.Tensor, keys: torch.Tensor, selected: int) -> torch.Tensor:
    """The `selected` tokens (all if fewer) with the highest max over query heads of q_h.k_t / sqrt(D),
    ascending: q [Hq, D] the step's query, keys [Hkv, n, D] after RoPE."""
    group = q.shape[0] // keys.shape[0]
    logits = torch.stack([keys[h // group] @ q[h] for h in range(q.shape[0])]) / math.sqrt(q.shape[-1])
    return logits.amax(0).topk(min(selected, keys.shape[1])).indices.sort().values


_active: Session | None = None


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, dropout: float = 0.0, scaling: float | None = None, **kwargs: Any):
    s, layer = _active, module.layer_idx
    k, v = key[0].float(), value[0].float()  # [Hkv, c, D], keys after RoPE
    start, c = s.length(layer), k.shape[1]
    s.store(layer, rope(k, torch.arange(start, start + c), s.inv_freq, sign=-1.0), v)
    n = start + c
    keys_pre, values = s.read(layer)
    keys = rope(keys_pre, torch.arange(n), s.inv_freq)
    if not s.decoding:  # a prefill chunk reads itself as computed
        keys[:, start:], values[:, start:] = k, v
        return harness.causal_attention(query, keys, values, scaling), None
    seen = torch.ones(n, dtype=torch.bool)
    if s.is_full(layer):
        s.chosen = choose(query[0, :, -1].float(), keys, s.params.selected)
        s.choices.append((layer, s.chosen))
    elif not s.reads_all(layer):
        seen = torch.zeros(n, dtype=torch.bool)
        seen[:s.params.sink] = True
        seen[s.chosen] = True
        seen[s.params.sink + s.compressed[layer]:] = True
    s.reads[-1][layer] = seen.nonzero()[:, 0]
    return harness.causal_attention(query, keys[:, seen], values[:, seen], scaling), None


AttentionInterface.register(NAME, _attention)


def session(model: PreTrainedModel, params: Params, compressor: Compressor) -> Session:
    cfg = model.config
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    want = (cfg.num_hidden_layers, cfg.num_key_value_heads, dim)
    if tuple(compressor.k_down.shape[:3]) != want:
        raise ValueError(f"the compressor is for [layers, Hkv, D] = {list(compressor.k_down.shape[:3])}, "
                         f"the model has {list(want)}")
    return Session(params, compressor, model.model.rotary_emb.inv_freq.detach().float(), cfg.num_hidden_layers)


def _forward(model: PreTrainedModel, s: Session, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), vocab] of `ids` appended to the session, then the compression."""
    global _active
    _active = s
    if s.decoding:
        s.reads.append({})
    try:
        logits = harness.forward(model, NAME, ids, s.length())
    finally:
        _active = None
    s.end_forward()
    return logits


def generate(model: PreTrainedModel, ids: list[int], params: Params, compressor: Compressor, max_new_tokens: int,
             chunk: int | None = None, stop_token_ids: Collection[int] = (), state: Session | None = None) -> list[int]:
    """Greedy: `ids` prefilled in chunks of `chunk` tokens (None: one), then decode steps until
    `max_new_tokens` tokens or a stop token (returned, as the engine does). Pass `state` (from
    `session`) to inspect the cache afterwards, or to continue it: the next call's ids then start
    with this call's last token, which no step has stored."""
    s = state if state is not None else session(model, params, compressor)
    chunk = chunk or len(ids)
    s.decoding = False
    for at in range(0, len(ids), chunk):
        last = _forward(model, s, list(ids[at:at + chunk]))[-1]
    tokens = [int(last.argmax())]
    s.decoding = True
    while len(tokens) < max_new_tokens and tokens[-1] not in stop_token_ids:
        tokens.append(int(_forward(model, s, [tokens[-1]])[-1].argmax()))
    return tokens
