"""SamplingParams: how one request picks its next tokens, validated up front.

Field names follow vLLM / the OpenAI API so that users and the server map onto them
directly. Every invalid value raises `InvalidSamplingParams` naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvc.runtime.errors import InvalidSamplingParams

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens whose mass reaches top_p
    top_k: int = 0  # 0 or -1: no limit
    seed: int | None = None  # per-request generator; None draws from the engine's generator
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        def bad(param: str, why: str) -> InvalidSamplingParams:
            value = getattr(self, param)
            return InvalidSamplingParams(f"invalid {param}={value!r}: {why}", param=param)

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise bad("max_tokens", "must be an integer")
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
