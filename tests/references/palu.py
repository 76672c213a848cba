"""A hand-written Palu reference: low-rank K/V per group of KV heads, keys cached before RoPE.

Written from the method's definition (methods/palu.kvm, runtime/kv/spec.py `LowRank`), with no kvc
code: numpy SVD for the projections, its own RoPE, a Hugging Face model for everything else.

- Projections (`bases`, `--decompose svd`): for each layer and group of g consecutive KV heads, the
  first r left singular vectors U [g D, r] of the group's K projection rows (each head's rows times
  its k-norm weight, where the model has one) and of its V rows; down = up = U. `whitened_bases`
  (`--decompose whiten`): the top r eigenvectors of the group's second moment of its keys before
  RoPE and of its values over calibration ids.
- Cache: a token's keys before RoPE (the model's post-RoPE keys rotated back by its position) and
  its values, each group's rows concatenated and projected: latent = x_G @ U. Read back as
  latent @ U^T, keys then rotated to their position.
- A prefill chunk attends to its own tokens as computed and to earlier ones as the cache holds
  them; a decode step attends to everything as the cache holds it, its own token included.
- Keys cached after RoPE (`prerope=False`, bench/variants/palu_postrope.kvm): the model's keys
  projected as they are and read back as they are, the whitening over those keys.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import AttentionInterface, PreTrainedModel

from tests.references import harness
from tests.references.harness import rope

NAME = "kvc_palu_reference"


def bases(model: PreTrainedModel, group: int, rank: int) -> list[dict[str, np.ndarray]]:
    """Per layer, {"k": U [groups, g D, r], "v": ...} (float64) from the model's weights."""
    cfg = model.config
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    out = []
    for layer in model.model.layers:
        attn = layer.self_attn
        k = attn.k_proj.weight.detach().double().numpy()
        v = attn.v_proj.weight.detach().double().numpy()
        norm = getattr(attn, "k_norm", None)
        if norm is not None:
            k = k * np.tile(norm.weight.detach().double().numpy(), k.shape[0] // dim)[:, None]
        per = {}
        for name, rows in (("k", k), ("v", v)):
            blocks = rows.reshape(-1, group * dim, rows.shape[1])
            per[name] = np.stack([np.linalg.svd(b, full_matrices=False)[0][:, :rank] for b in blocks])
        out.append(per)
    return out


def whitened_bases(model: PreTrainedModel, batches: list[list[int]], group: int, rank: int,
                   prerope: bool = True) -> list[dict[str, np.ndarray]]:
    """Per layer, {"k": U [groups, g D, r], "v": ...}: the top-r eigenvectors of each group's second
    moment of the keys before RoPE (the model's keys rotated back by their positions; `prerope`
    False: the keys as the model gives them) and of the values, over `batches` of ids (each from
    position 0)."""
    moments: dict = {}
    inv_freq = model.model.rotary_emb.inv_freq.detach().float()

    def record(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        layer, n = module.layer_idx, key.shape[2]
        pre = rope(key[0].float(), torch.arange(n), inv_freq, sign=-1.0) if prerope else key[0].float()
        for name, x in (("k", pre), ("v", value[0].float())):
            flat = x.permute(1, 0, 2).reshape(n, -1).double().numpy()
            moments[layer, name] = moments.get((layer, name), 0) + flat.T @ flat
        return harness.causal_attention(query, key[0].float(), value[0].float(), scaling), None

    AttentionInterface.register(NAME + "_moments", record)
    for ids in batches:
        harness.forward(model, NAME + "_moments", ids, 0)
    out = []
    for layer in range(len(model.model.layers)):
        per = {}
        for name in ("k", "v"):
            m = moments[layer, name]
            blocks = []
            for start in range(0, m.shape[0], group * (m.shape[0] // model.config.num_key_value_heads)):
                size = group * (m.shape[0] // model.config.num_key_value_heads)
                values, vectors = np.linalg.eigh(m[start:start + size, start:start + size])
                blocks.append(vectors[:, np.argsort(-values)[:rank]])
            per[name] = np.stack(blocks)
        out.append(per)
    return out


@dataclass
class Session:
    """Each layer's stored latents of K and V ([groups, n, r] float32) and the projections."""

    bases: list[dict[str, np.ndarray]]
    inv_freq: torch.Tensor
    prerope: bool = True  # keys cached before RoPE (else as the model gives them)
    decoding: bool = False
    latents: dict = field(default_factory=dict)  # (layer, "k"|"v") -> [groups, n, r]

    def length(self, layer: int = 0) -> int:
        got = self.latents.get((layer, "k"))
        return 0 if got is None else got.shape[1]

    def copy(self) -> Session:
        return copy.deepcopy(self)

    def truncate(self, n: int) -> Session:
        """The session as it was after its first n tokens."""
        out = self.copy()
        out.latents = {key: x[:, :n] for key, x in out.latents.items()}
        return out

    def store(self, layer: int, which: str, x: torch.Tensor) -> None:
        """x [Hkv, c, D] (keys before RoPE) into the layer's latents."""
        u = torch.from_numpy(self.bases[layer][which]).float()  # [G, g D, r]
        groups, heads, c = u.shape[0], x.shape[0], x.shape[1]
        x_g = x.float().reshape(groups, heads // groups, c, -1).permute(0, 2, 1, 3).reshape(groups, c, -1)
        new = torch.einsum("gcd,gdr->gcr", x_g, u)
        old = self.latents.get((layer, which))
        self.latents[layer, which] = new if old is None else torch.cat([old, new], dim=1)

    def read(self, layer: int, which: str, heads: int) -> torch.Tensor:
        """The layer's stored rows [Hkv, n, D] (keys still before RoPE)."""
        u = torch.from_numpy(self.bases[layer][which]).float()
        x_g = torch.einsum("gnr,gdr->gnd", self.latents[layer, which], u)  # [G, n, g D]
        groups, n = x_g.shape[0], x_g.shape[1]
        return x_g.reshape(groups, n, heads // groups, -1).permute(0, 2, 1, 3).reshape(heads, n, -1)


_active: Session | None = None


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, dropout: float = 0.0, scaling: float | None = None, **kwargs: Any):
    s, layer = _active, module.layer_idx
    k, v = key[0].float(), value[0].float()  # [Hkv, c, D], keys after RoPE
    heads, c = k.shape[0], k.shape[1]
    start = s.length(layer)
    s.store(layer, "k", rope(k, torch.arange(start, start + c), s.inv_freq, sign=-1.0) if s.prerope else k)
    s.store(layer, "v", v)
    n = start + c
    keys = rope(s.read(layer, "k", heads), torch.arange(n), s.inv_freq) if s.prerope else s.read(layer, "k", heads)
    values = s.read(layer, "v", heads)
    if not s.decoding:  # a prefill chunk reads itself as computed
        keys[:, start:], values[:, start:] = k, v
    return harness.causal_attention(query, keys, values, scaling), None


AttentionInterface.register(NAME, _attention)


def session(model: PreTrainedModel, group: int, rank: int) -> Session:
    return Session(bases(model, group, rank), model.model.rotary_emb.inv_freq.detach().float())


def _forward(model: PreTrainedModel, s: Session, ids: list[int]) -> torch.Tensor:
    global _active
    _active = s
    try:
        return harness.forward(model, NAME, ids, s.length())
    finally:
        _active = None


def generate(model: PreTrainedModel, s: Session, prompt: list[int], steps: int,
             chunk: int | None = None) -> tuple[list[int], torch.Tensor]:
    """Greedy: `prompt` in chunks of `chunk` tokens (None: one), then `steps - 1` decode steps; the
    tokens and the logits they were sampled from."""
    chunk = chunk or len(prompt)
    s.decoding = False
    for at in range(0, len(prompt), chunk):
        last = _forward(model, s, prompt[at:at + chunk])[-1]
    logits = [last]
    tokens = [int(last.argmax())]
    s.decoding = True
    for _ in range(steps - 1):
        logits.append(_forward(model, s, [tokens[-1]])[-1])
        tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits)
