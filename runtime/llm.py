"""The offline Python API: `LLM(model=..., method="full").generate(prompts, params)`.

Multi-turn sessions go through the chain cache: `generate(prompt, params, chain=ChainSpec(open=True))`
returns outputs with a `chain_id`; the next turn passes the whole conversation with
`chain=ChainSpec(continue_id=...)` (or `fork_id=...`) and only the new suffix is prefilled
(`num_cached_tokens` says how many tokens were reused).

Several methods: `LLM(method="full", methods=["snapkv", "kivi"])` serves each; a request picks one
with `generate(..., method="snapkv", method_params={"budget": 1024})` (or `SamplingParams.method`), the
default otherwise, and all of them decode in one batch (runtime/lanes.py).

Outputs carry what `SamplingParams` asked for: `logprobs` (one `TokenLogprobs` per generated
token: its logprob, rank and the top N), `prompt_logprobs` (one per prompt token, None for the
first), and `stop_reason` (the stop token id that ended the request, else None).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace
from typing import Any

from kvc.runtime.chains import ChainSpec
from kvc.runtime.config import EngineConfig
from kvc.runtime.engine import Engine
from kvc.runtime.errors import ConfigError, InvalidPromptError, InvalidSamplingParams
from kvc.runtime.logprobs import TokenLogprobs
from kvc.runtime.prefill_record import PrefillRecord
from kvc.runtime.sampling_params import SamplingParams
from kvc.runtime.sequence import Sequence

Prompt = str | list[int]


@dataclass
class RequestOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]  # the new tokens only
    text: str
    finish_reason: str | None
    num_cached_tokens: int = 0  # prompt tokens not prefilled: prefix-cache hits or chain reuse
    metrics: dict[str, Any] = field(default_factory=dict)
    chain_id: str | None = None  # the chain this request opened, continued or forked
    logprobs: list[TokenLogprobs] | None = None  # per generated token (SamplingParams.logprobs)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # per prompt token, None first (prompt_logprobs)
    stop_reason: int | None = None  # the stop token id that ended it (None: EOS, length, abort)
    method: str | None = None  # the KV method it ran (its name)


class LLM:
    """An engine plus tokenization: the Python face of kvc."""

    def __init__(self, model: str | None = None, method: str = "full", **options: Any) -> None:
        try:
            config = EngineConfig(model=model, method=method, **options)
        except TypeError as e:
            raise ConfigError(f"LLM(): {e}") from None
        self.engine = Engine(config)
        self.tokenizer = self.engine.tokenizer

    @classmethod
    def from_engine(cls, engine: Engine) -> LLM:
        """The Python API over an engine built elsewhere (e.g. one that shares a loaded model)."""
        llm = cls.__new__(cls)
        llm.engine, llm.tokenizer = engine, engine.tokenizer
        return llm

    def close(self) -> None:
        """Stops the engine's follower ranks (tensor parallelism); the LLM is unusable after."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError("this model has no tokenizer; pass prompts as lists of token ids", param="prompt")
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        raise InvalidPromptError("a prompt must be a string or a list of token ids", param="prompt")

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
        chain: ChainSpec | Seq[ChainSpec | None] | None = None,
        on_finished: Callable[[int], None] | None = None,
        record: Seq[PrefillRecord | None] | None = None,
        replay: Seq[PrefillRecord | None] | None = None,
        method: str | Seq[str | None] | None = None,
        method_params: dict | Seq[dict | None] | None = None,
    ) -> list[RequestOutput]:
        """Generates for all prompts together (continuous batching); outputs keep prompt order.
        `chain`: one `ChainSpec` per prompt (or one for a single prompt), None for no chain.
        `on_finished(n)`: called after each engine step that finished n > 0 requests (a caller's
        own progress bar). `record` / `replay`: per prompt, a `PrefillRecord` to capture its prefill
        into, or to take it from (runtime/prefill_record.py). `method` / `method_params`: the KV method
        (one the engine serves) and its parameters, for every prompt or one per prompt; they override
        the SamplingParams' own."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise InvalidSamplingParams(
                f"got {len(params)} SamplingParams for {len(prompts)} prompts", param="params"
            )
        chains = [chain] * len(prompts) if chain is None or isinstance(chain, ChainSpec) else list(chain)
        if len(chains) != len(prompts) or (isinstance(chain, ChainSpec) and len(prompts) != 1):
            raise InvalidPromptError(f"got {len(chains)} chain specs for {len(prompts)} prompts", param="chain")
        records = list(record) if record is not None else [None] * len(prompts)
        replays = list(replay) if replay is not None else [None] * len(prompts)
        if len(records) != len(prompts) or len(replays) != len(prompts):
            raise InvalidPromptError("record / replay take one entry per prompt", param="record")
        params = _with_methods(params, method, method_params)
        token_lists = [self.encode(p) for p in prompts]  # all errors before any work starts
        seqs: list[Sequence] = []
        try:
            for ids, p, c, rec, rep in zip(token_lists, params, chains, records, replays):
                seqs.append(self.engine.add_request(ids, p, chain=c, record=rec, replay=rep))
            self._run(len(seqs), use_tqdm, on_finished)
        finally:
            for seq in seqs:  # an error or Ctrl-C mid-run must not leave pages behind
                if not seq.is_finished:
                    self.engine.abort(seq.seq_id)
        return [
            RequestOutput(
                prompt=p if isinstance(p, str) else None,
                prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
                token_ids=list(seq.generated_ids),
                text=self.decode(list(seq.generated_ids)),
                finish_reason=seq.finish_reason,
                num_cached_tokens=seq.num_cached_tokens,
                chain_id=seq.chain_id,
                logprobs=seq.logprobs,
                prompt_logprobs=seq.prompt_logprobs,
                stop_reason=seq.stop_reason,
                method=self.engine.lane_of(seq).name,
            )
            for p, seq in zip(prompts, seqs)
        ]

    def _run(self, total: int, use_tqdm: bool, on_finished: Callable[[int], None] | None = None) -> None:
        if not use_tqdm:
            while self.engine.has_unfinished():
                finished = len(self.engine.step())
                if finished and on_finished is not None:
                    on_finished(finished)
            return
        from rich.progress import Progress

        with Progress(transient=True) as progress:
            task = progress.add_task("generating", total=total)
            while self.engine.has_unfinished():
                progress.advance(task, len(self.engine.step()))


def _with_methods(params: list[SamplingParams], method, method_params) -> list[SamplingParams]:
    """`params` with the method (and its parameters) `generate` names, one for all or one per prompt."""
    n = len(params)

    def per_prompt(value, what: str, single) -> list:
        if value is None or isinstance(value, single):
            return [value] * n
        values = list(value)
        if len(values) != n:
            raise InvalidSamplingParams(f"got {len(values)} {what} for {n} prompts", param=what)
        return values

    methods = per_prompt(method, "method", str)
    method_params = per_prompt(method_params, "method_params", dict)
    return [p if m is None and mp is None else
            replace(p, method=p.method if m is None else m, method_params=p.method_params if mp is None else mp)
            for p, m, mp in zip(params, methods, method_params)]
