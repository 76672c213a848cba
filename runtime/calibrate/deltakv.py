"""Trains a DeltaKV compressor: per compressed layer, low-rank codes of each token's difference from
its reference (a `Delta` store; docs/design.md, "DeltaKV").

Pipeline position: a tool beside the engine (`kvc calibrate`, runtime/calibrate/cli.py), like
lowrank.py; it writes the method's input file. The algorithm is the DeltaKV paper's (its reference:
Sparse-vLLM), with the model frozen:

- a token's vector x (its keys before RoPE and its values, all KV heads side by side) is stored as
  `code = down(x) - down(ref)`, ref the mean of the raw x of its `neighbours` nearest centers
  (squared L2 over x); centers are the sinks and every `stride`-th token of a compressed block,
  among those at or before the token (runtime/kv/delta.py, the arithmetic the store will share).
  Read back: `x^ = ref + up(code) + bias`; centers themselves stay raw. One code covers keys and
  values (the paper's default), so the channels go where the error is (values, on the embedded
  model: docs/accuracy.md);
- initialisation: the principal directions of the deltas d = x - ref over calibration text (the
  least-squares optimum of a linear code): down = up = U (the top `code` eigenvectors of cov(d)),
  bias = mu - U U^T mu (mu the mean delta, which the code cannot carry: down's bias cancels in the
  difference);
- then AdamW (the paper's optimiser) on the next-token cross-entropy of the model whose compressed
  layers attend to reconstructed keys and values, plus `mse` times each layer's relative
  reconstruction error (the paper's two terms).

Calibration sequences are `context` tokens; each compressed layer compresses one block, positions
[sink, sink + n) with n the multiple of `recent` that leaves at least `recent` raw at the end (the
paper's schedule at that length).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812

from kvc.runtime.kv.delta import block_of, center_positions, is_center, references
from kvc.runtime.kv.lowrank import rope

ATTENTION_NAME = "kvc_deltakv_calibration"


@dataclass
class DeltaConfig:
    layers: list[int]  # the compressed layers (every other layer's tensors are zeros)
    code: int  # latent channels of a token (keys and values, all KV heads)
    sink: int = 8
    recent: int = 128
    stride: int = 8
    neighbours: int = 4
    steps: int = 80  # AdamW steps after the PCA initialisation (0: PCA only)
    lr: float = 2e-4  # the paper's
    mse: float = 1.0  # weight of the relative reconstruction error
    bf16: bool = True  # autocast the model's matmuls (the compressor and the loss stay float32)


@dataclass
class DeltaResult:
    tensors: dict[str, torch.Tensor]  # down, up [layers, 2, Hkv, D, C]; bias [layers, 2, Hkv, D] (K then V)
    losses: list[float] = field(default_factory=list)  # cross-entropy per fine-tuning step
    errors: dict[str, float] = field(default_factory=dict)  # relative reconstruction error: "pca", "final"
    ce: dict[str, float] = field(default_factory=dict)  # cross-entropy on held-out text: "full", "pca", "final"
    seconds: float = 0.0


def _operands(k_pre: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[T, Hkv, D] keys before RoPE and values -> [T, 2 Hkv D]: a token's whole vector."""
    return torch.cat([k_pre.reshape(k_pre.shape[0], -1), v.reshape(v.shape[0], -1)], 1)


class _Compressor(torch.nn.Module):
    """down, up [2 Hkv D, C] and bias [2 Hkv D] per compressed layer (float32)."""

    def __init__(self, init: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        super().__init__()
        self.params = torch.nn.ParameterDict()
        for layer, (u, bias) in init.items():
            self.params[f"down_{layer}"] = torch.nn.Parameter(u.clone())
            self.params[f"up_{layer}"] = torch.nn.Parameter(u.clone())
            self.params[f"bias_{layer}"] = torch.nn.Parameter(bias.clone())

    def reconstruct(self, layer: int, x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
        """x^ = ref + up(down(x) - down(ref)) + bias, rows [n, 2 Hkv D]."""
        down, up = self.params[f"down_{layer}"], self.params[f"up_{layer}"]
        return ref + ((x - ref) @ down) @ up.T + self.params[f"bias_{layer}"]


class _Attention:
    """A Hugging Face attention function (transformers' `AttentionInterface`; the HF model, not kvc's,
    because kvc's computes in place where autograd needs the inputs): plain causal attention, where a
    compressed layer's block of non-center tokens reads its reconstructed keys and values
    (`compressor` set), or records its vectors (`record` set)."""

    def __init__(self, cfg: DeltaConfig, inv_freq: torch.Tensor) -> None:
        self.cfg, self.inv_freq = cfg, inv_freq
        self.compressor: _Compressor | None = None
        self.record: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
        self.errors: list[torch.Tensor] = []

    def __call__(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        # query [1, Hq, T, D], key / value [1, Hkv, T, D], keys after RoPE
        cfg, layer = self.cfg, module.layer_idx
        k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, Hkv, D]
        start, end = block_of(k.shape[0], 0, cfg.sink, cfg.recent)
        if layer in cfg.layers and end > start and (self.compressor is not None or self.record is not None):
            k, v = self._compressed(layer, k, v, start, end)
        group = query.shape[1] // key.shape[1]
        out = F.scaled_dot_product_attention(
            query, k.transpose(0, 1)[None].repeat_interleave(group, 1),
            v.transpose(0, 1)[None].repeat_interleave(group, 1), is_causal=True, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    def _compressed(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int, end: int):
        cfg = self.cfg
        length, heads, dim = k.shape
        positions = torch.arange(length, device=k.device)
        k_pre = rope(k.transpose(0, 1), positions, self.inv_freq, inverse=True).transpose(0, 1)  # [T, Hkv, D]
        x = _operands(k_pre, v.float())
        centers = center_positions(end, cfg.sink, cfg.stride).to(k.device)
        block = torch.arange(start, end, device=k.device)
        rows = block[~is_center(block, cfg.sink, cfg.stride)]
        with torch.no_grad():
            ref, _ = references(x[rows].detach(), rows, x[centers].detach(), centers, cfg.neighbours)
        if self.record is not None:
            self.record[layer] = (x[rows].detach(), ref, rows)
            return k, v
        rec = self.compressor.reconstruct(layer, x[rows], ref)
        self.errors.append((rec - x[rows]).square().sum() / x[rows].square().sum().clamp(min=1e-12))
        k_rec, v_rec = rec.reshape(-1, 2, heads, dim).unbind(1)
        k, v = k.clone(), v.clone()
        k[rows] = rope(k_rec.transpose(0, 1), rows, self.inv_freq).transpose(0, 1).to(k.dtype)
        v[rows] = v_rec.to(v.dtype)
        return k, v


def _pca(delta: torch.Tensor, code: int) -> tuple[torch.Tensor, torch.Tensor]:
    """delta [n, F] -> (U [F, code], bias [F]): the top principal directions and mu - U U^T mu."""
    mu = delta.double().mean(0)
    centred = delta.double() - mu
    values, vectors = torch.linalg.eigh(centred.T @ centred)
    u = vectors[:, values.argsort(descending=True)[:code]]
    return u.float(), (mu - u @ (u.T @ mu)).float()


def calibrate(model_dir: Path, batches: list[torch.Tensor], cfg: DeltaConfig,
              progress: Callable[[int, float], None] | None = None,
              held: list[torch.Tensor] | None = None) -> DeltaResult:
    """Trains the compressor of the model in `model_dir` (a Hugging Face directory; weights frozen) on
    `batches` of token ids, on their device; the cross-entropy and reconstruction error it reports are
    over `held` (default: the batches)."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    held = held or batches
    start_time = time.perf_counter()
    device = batches[0].device
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device)
    model.requires_grad_(False)
    model.eval()
    config = model.config
    heads = config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    width = 2 * heads * dim
    if not 0 < cfg.code <= width:
        raise ValueError(f"a code of {cfg.code} channels for tokens of {width}: give 1..{width}")
    attn = _Attention(cfg, model.model.rotary_emb.inv_freq)
    AttentionInterface.register(ATTENTION_NAME, attn)
    model.set_attn_implementation(ATTENTION_NAME)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16)
    # 1. the deltas of every compressed layer over the calibration text, from the exact model
    deltas: dict[int, list[torch.Tensor]] = {}
    attn.record = {}
    with torch.no_grad(), autocast:
        for ids in batches:
            model(input_ids=ids[None])
            for layer, (x, ref, _) in attn.record.items():
                deltas.setdefault(layer, []).append((x - ref).float().cpu())
    attn.record = None
    if not deltas:
        raise ValueError(f"calibration sequences of {batches[0].shape[0]} tokens leave no block to compress (sink "
                         f"{cfg.sink} + 2 x recent {cfg.recent} needed)")
    init = {key: _pca(torch.cat(rows), cfg.code) for key, rows in deltas.items()}
    compressor = _Compressor(init).to(device)
    attn.compressor = compressor
    result = DeltaResult({})
    attn.compressor = None
    result.ce["full"] = _evaluate(model, attn, held, autocast)[0]
    attn.compressor = compressor
    result.ce["pca"], result.errors["pca"] = _evaluate(model, attn, held, autocast)
    # 2. AdamW on cross-entropy + reconstruction error through the frozen model
    optimizer = torch.optim.AdamW(compressor.parameters(), lr=cfg.lr)
    for step in range(cfg.steps):
        ids = batches[step % len(batches)]
        attn.errors = []
        with autocast:
            logits = model(input_ids=ids[None, :-1]).logits[0]
        ce = F.cross_entropy(logits.float(), ids[1:])
        loss = ce + cfg.mse * torch.stack(attn.errors).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        result.losses.append(float(ce.detach()))
        if progress is not None:
            progress(step, float(ce.detach()))
    result.ce["final"], result.errors["final"] = _evaluate(model, attn, held, autocast)
    attn.compressor = None
    result.tensors = _tensors(compressor, cfg, config.num_hidden_layers, heads, dim)
    result.seconds = time.perf_counter() - start_time
    return result


def _evaluate(model, attn: _Attention, batches: list[torch.Tensor], autocast) -> tuple[float, float]:
    """(next-token cross-entropy, mean relative reconstruction error) over the batches and compressed
    layers (error 0 without a compressor)."""
    attn.errors, losses = [], []
    with torch.no_grad(), autocast:
        for ids in batches:
            logits = model(input_ids=ids[None, :-1]).logits[0]
            losses.append(float(F.cross_entropy(logits.float(), ids[1:])))
    error = float(torch.stack(attn.errors).mean()) if attn.errors else 0.0
    return sum(losses) / len(losses), error


def _tensors(compressor: _Compressor, cfg: DeltaConfig, layers: int, heads: int, dim: int) -> dict[str, torch.Tensor]:
    """The method's inputs: projections [layers, 2, Hkv, D, C] and biases [layers, 2, Hkv, D] (K's rows,
    then V's), zeros for layers that are not compressed."""
    down = torch.zeros(layers, 2, heads, dim, cfg.code)
    up, bias = torch.zeros_like(down), torch.zeros(layers, 2, heads, dim)
    for layer in cfg.layers:
        for name, out in (("down", down), ("up", up)):
            out[layer] = compressor.params[f"{name}_{layer}"].detach().float().cpu().reshape(2, heads, dim, -1)
        bias[layer] = compressor.params[f"bias_{layer}"].detach().float().cpu().reshape(2, heads, dim)
    return {"down": down, "up": up, "bias": bias}


def as_inputs(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The trained tensors as methods/deltakv.kvm declares its inputs: `down`, `up` [layers, Hkv, 2 D, C]
    (each KV head's key rows, then its value rows: a projection's `channel` axis of a joint store) and
    `bias` [layers, Hkv, 2 D]."""
    layers, _, heads, dim = tensors["bias"].shape
    out = {part: tensors[part].permute(0, 2, 1, 3, 4).reshape(layers, heads, 2 * dim, -1) for part in ("down", "up")}
    out["bias"] = tensors["bias"].permute(0, 2, 1, 3).reshape(layers, heads, 2 * dim)
    return out
