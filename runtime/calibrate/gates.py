"""Calibrates per-KV-head attention gates: DuoAttention's retrieval-head identification.

Pipeline position: a tool beside the engine (`kvc calibrate`, runtime/calibrate/cli.py); it writes
a method input file (runtime/models/method_inputs.py) that the engine reads at bind. The algorithm
is the DuoAttention paper's (Xiao et al. 2025, Sec. 3.2): every KV head (l, h) gets a gate alpha in
[0, 1]; its attention output is alpha * full causal attention + (1 - alpha) * streaming attention
(each query sees the first `sink` tokens and its `recent` newest ones, itself included); the model's
weights stay frozen and only the gates train, with Adam, on synthetic passkey contexts, to minimise
the squared error between the final hidden states of that mixed model and of the full one, summed
over each context's last `tail` tokens (the question and the answer) and channels, plus `l1` times
the gates' L1 norm (the paper's lambda = 0.05 on the sum).
Heads whose outputs the streaming pattern cannot replace keep high gates (retrieval heads); the
engine streams the lowest-gated ones. docs/design.md, "Calibrating DuoAttention's gates".
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F  # noqa: N812

log = logging.getLogger(__name__)
ATTENTION_NAME = "kvc_gate_calibration"


@dataclass
class GateConfig:
    sink: int = 4  # the streaming pattern's sinks and window at the calibration context (scaled)
    recent: int = 16
    context: int = 1024  # tokens per synthetic passkey context
    samples: int = 8  # distinct contexts, cycled over the steps
    steps: int = 200
    lr: float = 0.02  # Adam, as the paper
    l1: float = 0.05  # weight of the gates' L1 norm (the paper's lambda)
    tail: int = 32  # the tokens the distillation loss covers: each context's last ones
    seed: int = 1000  # the contexts' seed (kvc eval's cases use 0: no overlap)
    bf16: bool = True  # autocast the model to bfloat16 (the gates and the loss stay float32)


@dataclass
class GateResult:
    gate: torch.Tensor  # [layers, kv_heads] float32 in [0, 1]
    losses: list[float] = field(default_factory=list)  # distillation loss per step
    seconds: float = 0.0


def streaming_mask(n: int, sink: int, recent: int) -> torch.Tensor:
    """bool [n, n]: query i sees key j when j <= i and (j < sink or i - j < recent)."""
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    return (j <= i) & ((j < sink) | (i - j < recent))


class _Mixer:
    """The attention both the teacher (`alpha` None: full attention) and the student run."""

    def __init__(self, kv_heads: int, sink: int, recent: int) -> None:
        self.kv_heads, self.sink, self.recent = kv_heads, sink, recent
        self.alpha: torch.Tensor | None = None  # [layers, kv_heads] during the student's forward

    def __call__(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        # query [B, Hq, n, D], key/value [B, Hkv, n, D] (transformers' attention interface)
        group = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
        full = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
        if self.alpha is None:
            out = full
        else:
            mask = streaming_mask(query.shape[2], self.sink, self.recent).to(query.device)
            streaming = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
            a = self.alpha[module.layer_idx].repeat_interleave(group)[None, :, None, None]
            out = a * full + (1 - a) * streaming
        return out.transpose(1, 2).contiguous(), None


def passkey_contexts(tokenizer, cfg: GateConfig) -> list[torch.Tensor]:
    """`samples` synthetic passkey contexts of `context` tokens, each followed by its answer (the
    tokens the loss covers end with the key itself)."""
    from kvc.runtime.eval.tasks import make_cases

    cases = make_cases("passkey", tokenizer, cfg.context, cfg.samples, cfg.seed)
    out = []
    for case in cases:
        answer = tokenizer.encode(f" {case.answer}.", add_special_tokens=False)
        out.append(torch.tensor([*case.prompt, *answer])[None])
    return out


def calibrate(model_dir: Path, cfg: GateConfig, progress: Callable[[int, float], None] | None = None) -> GateResult:
    """Trains the gates of the model in `model_dir` (a Hugging Face directory; weights frozen)."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    from kvc.runtime.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    if tokenizer is None:
        raise ValueError(f"{model_dir}: calibration needs the model's tokenizer (passkey contexts)")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.requires_grad_(False)
    model.eval()
    config = model.config
    layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
    mixer = _Mixer(kv_heads, cfg.sink, cfg.recent)
    AttentionInterface.register(ATTENTION_NAME, mixer)
    model.set_attn_implementation(ATTENTION_NAME)
    contexts = passkey_contexts(tokenizer, cfg)
    # bf16 autocast: AMX/AVX-512 matmuls, ~2.6x a float32 forward on the CPU; the gates and the loss
    # stay float32, and teacher and student share the precision (at alpha = 1 the loss is 0)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16)
    with torch.no_grad(), autocast:  # the full model's final hidden states, once per context
        mixer.alpha = None
        targets = [model.model(input_ids=ids).last_hidden_state[:, -cfg.tail:].float() for ids in contexts]
    alpha = torch.ones(layers, kv_heads, requires_grad=True)
    optimizer = torch.optim.Adam([alpha], lr=cfg.lr)
    result = GateResult(alpha.detach().clone())
    start = time.perf_counter()
    for step in range(cfg.steps):
        i = step % len(contexts)
        mixer.alpha = alpha
        with autocast:
            hidden = model.model(input_ids=contexts[i]).last_hidden_state[:, -cfg.tail:].float()
        # the paper's scales: squared error summed over the tail's tokens and channels, L1 summed over heads
        distill = (hidden - targets[i]).pow(2).sum()
        loss = distill + cfg.l1 * alpha.abs().sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            alpha.clamp_(0.0, 1.0)  # the paper's gates live in [0, 1]
        result.losses.append(float(distill.detach()))
        if progress is not None:
            progress(step, float(distill))
    mixer.alpha = None
    result.gate = alpha.detach().clone()
    result.seconds = time.perf_counter() - start
    return result
