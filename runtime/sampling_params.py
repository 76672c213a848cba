"""SamplingParams: how one request picks its next tokens, validated up front.

Field names follow vLLM / the OpenAI API so that users and the server map onto them
directly. Every invalid value raises `InvalidSamplingParams` naming the field. What the sampler
does with each field, and in which order: runtime/sampler.py and docs/design.md, "Sampling".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvc.runtime.errors import InvalidSamplingParams
from kvc.runtime.structured_outputs import StructuredOutputs

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
MAX_LOGPROBS = 20  # top logprobs per token (OpenAI's top_logprobs limit; vLLM's default max_logprobs)
LOGIT_BIAS_MAX = 100.0  # OpenAI's range for a logit bias: [-100, 100]


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens whose mass reaches top_p
    top_k: int = 0  # 0 or -1: no limit
    seed: int | None = None  # per-request generator; None draws from the engine's generator
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop tokens are masked until this many tokens are generated
    min_p: float = 0.0  # drop tokens whose probability is below min_p x the top token's
    presence_penalty: float = 0.0  # OpenAI: minus this for every token generated at least once
    frequency_penalty: float = 0.0  # OpenAI: minus this times how often each token was generated
    repetition_penalty: float = 1.0  # vLLM / HF: tokens of the prompt or the output: logit / r if > 0, else x r
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI: [-100, 100])
    logprobs: int | None = None  # per generated token: its logprob and the top N; None: none; 0: only its own
    prompt_logprobs: int | None = None  # the same for every prompt token (the first has none)
    structured_outputs: StructuredOutputs | None = None  # what the output must match (a grammar)
    # the KV method the request runs (one the engine serves; None: its default) and its parameters over
    # the served ones' (runtime/lanes.py; the engine checks both when the request is added)
    method: str | None = None
    method_params: dict | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Does the sampler need this request's token counts (runtime/penalties.py)?"""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def changes_logits(self) -> bool:
        """Does anything change the model's logits before greedy choice or temperature?"""
        return self.has_penalties or bool(self.logit_bias) or self.min_tokens > 0

    def validate(self) -> None:
        def bad(param: str, why: str) -> InvalidSamplingParams:
            value = getattr(self, param)
            return InvalidSamplingParams(f"invalid {param}={value!r}: {why}", param=param)

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise bad("max_tokens", "must be an integer")
        if self.method is not None and (not isinstance(self.method, str) or not self.method):
            raise bad("method", "must be the name of a method the engine serves")
        if self.method_params is not None and not isinstance(self.method_params, dict):
            raise bad("method_params", "must be a dict of the method's parameters")
        if self.max_tokens < 1:
            raise bad("max_tokens", "must be at least 1")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
                raise bad(name, "must be a number")
            setattr(self, name, float(value))
        if self.temperature < 0 or math.isinf(self.temperature):
            raise bad("temperature", "must be finite and >= 0 (0 = greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise bad("top_k", "must be an integer")
        if self.top_k < -1:
            raise bad("top_k", "must be -1 or 0 (no limit) or a positive integer")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise bad("seed", "must be an integer or None")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise bad("seed", f"must be in [{SEED_MIN}, {SEED_MAX}]")
        if isinstance(self.stop_token_ids, int) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise bad("stop_token_ids", "must be a list of non-negative integers")
        self.stop_token_ids = list(self.stop_token_ids)
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be a non-negative integer")
        if self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be at most max_tokens ({self.max_tokens})")
        for name in ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(name, "must be a finite number")
            setattr(self, name, float(value))
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, "must be in [-2, 2]")
        if self.repetition_penalty <= 0.0:
            raise bad("repetition_penalty", "must be > 0 (1 = no penalty)")
        if self.logit_bias is not None:
            self.logit_bias = self._checked_bias(bad)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise bad("structured_outputs", "must be a StructuredOutputs (kvc.runtime.structured_outputs)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
                raise bad(name, f"must be None or an integer in [0, {MAX_LOGPROBS}] (0: only the token's own)")

    def _checked_bias(self, bad) -> dict[int, float]:
        if not isinstance(self.logit_bias, dict):
            raise bad("logit_bias", "must be a dict of token id -> bias")
        out = {}
        for token, bias in self.logit_bias.items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise bad("logit_bias", f"token id {token!r} must be a non-negative integer")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
                raise bad("logit_bias", f"the bias of token {token} must be a finite number")
            if not -LOGIT_BIAS_MAX <= bias <= LOGIT_BIAS_MAX:
                raise bad("logit_bias", f"the bias of token {token} must be in [-100, 100]")
            out[token] = float(bias)
        return out
