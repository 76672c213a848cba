"""One HTTP generation request as a stream of per-choice text deltas.

`Generation` sits between the OpenAI handlers and the `AsyncEngine`: it submits the request's
sequences (prompts x n), turns each step's tokens into text (`ChoiceText`: incremental
detokenization, stop strings), ends a choice early on a stop string, watches for the client
going away (then aborts at once, so the pages are freed), records metrics, and always releases
the engine's sequences when the handler is done, however it ends (a choice still running then,
e.g. a stream whose client went away, is counted as aborted). Logprobs (when asked) go with
the tokens each delta shows; a choice's prompt logprobs arrive with its first output. A chained
request (one sequence) carries its `ChainSpec` to the engine and the engine's chain id back.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from fastapi import Request as HttpRequest

from kvc.runtime.chains import ChainSpec
from kvc.runtime.sampling_params import SEED_MAX, SamplingParams
from kvc.runtime.sequence import FINISH_ABORT, FINISH_STOP
from kvc.runtime.server.async_engine import FINISH_ERROR, AsyncEngine, Output, Request
from kvc.runtime.server.metrics import ServerMetrics
from kvc.runtime.server.text import ChoiceText


@dataclass
class Delta:
    """What one choice gained in one step."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list | None = None  # one TokenLogprobs per token of `token_ids` (requests that ask)
    stop_reason: int | str | None = None  # the stop token id or stop string that ended the choice


@dataclass
class Choice:
    index: int
    prompt_index: int
    params: SamplingParams
    text: ChoiceText
    silent_ids: frozenset[int]  # tokens that end the sequence without showing their text
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    first_time: float | None = None
    last_time: float = 0.0
    logprobs: list | None = None  # per received token (requests that ask)
    prompt_logprobs: list | None = None
    stop_reason: int | str | None = None
    scheduled_time: float | None = None  # when an engine step first ran it
    last_token_time: float = 0.0
    token_gap: float | None = None  # the last output's time since this choice's previous tokens
    _counted: int = field(default=0, repr=False)

    def feed(self, out: Output) -> Delta:
        ids = out.token_ids
        self.token_gap = out.time - self.last_token_time if ids and self.first_time is not None else None
        if ids and self.first_time is None:
            self.first_time = out.time
        if ids:
            self.last_token_time = out.time
        self.last_time = out.time
        self.scheduled_time = out.scheduled if out.scheduled is not None else self.scheduled_time
        self.num_prompt_tokens = out.num_prompt_tokens or self.num_prompt_tokens
        # the engine's figure at the sequence's last admission (a preempted sequence is recomputed)
        self.num_cached_tokens = out.num_cached_tokens
        if out.logprobs is not None:
            self.logprobs = self.logprobs if self.logprobs is not None else []
            self.logprobs.extend(out.logprobs)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        silent = out.finish_reason == FINISH_STOP and ids and ids[-1] in self.silent_ids
        text = self.text.add(ids[:-1] if silent else ids)
        if silent:
            self.text.add_silent(ids[-1:])
        if self.text.stopped:
            self.finish_reason, self.stop_reason = FINISH_STOP, self.text.stops.matched
        elif out.finish_reason is not None:
            text += self.text.finish()
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        start, self._counted = self._counted, len(self.text.token_ids)
        logprobs = None if self.logprobs is None else self.logprobs[start : self._counted]
        return Delta(self.index, text, self.text.token_ids[start:], self.finish_reason, logprobs, self.stop_reason)

    @property
    def output_logprobs(self) -> list | None:
        """Logprobs of the tokens that count as output (up to a stop string)."""
        return None if self.logprobs is None else self.logprobs[: len(self.text.token_ids)]

    @property
    def num_output_tokens(self) -> int:
        return len(self.text.token_ids)


class Generation:
    def __init__(
        self,
        aengine: AsyncEngine,
        metrics: ServerMetrics,
        tokenizer,
        eos_token_ids: tuple[int, ...],
        prompts: list[list[int]],
        params: list[SamplingParams],  # one per prompt
        n: int,
        stop: list[str],
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        chain: ChainSpec | None = None,
    ) -> None:
        self.aengine = aengine
        self.chain = chain
        self.metrics = metrics
        self.prompts = [p for p in prompts for _ in range(n)]
        self.params: list[SamplingParams] = []
        self.choices: list[Choice] = []
        for i, p in enumerate(params):
            for j in range(n):
                seeded = p if p.seed is None or j == 0 else _with_seed(p, p.seed + j)
                silent = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
                self.params.append(seeded)
                self.choices.append(Choice(
                    index=len(self.choices), prompt_index=i, params=seeded,
                    text=ChoiceText(tokenizer, stop, include_stop_str_in_output, skip_special_tokens, p.min_tokens),
                    silent_ids=frozenset(silent),
                ))
        self.request: Request | None = None
        self._watch: asyncio.Task | None = None
        self.disconnected = False

    async def start(self, http: HttpRequest | None) -> None:
        """Queues the sequences (raises the engine's error if it rejects them) and starts watching
        for a client disconnect."""
        self.request = await self.aengine.submit(self.prompts, self.params, self.chain)
        if http is not None:
            self._watch = asyncio.ensure_future(self._watch_disconnect(http))

    async def _watch_disconnect(self, http: HttpRequest) -> None:
        while (await http.receive())["type"] != "http.disconnect":
            pass
        if not self.finished:
            self.disconnected = True
            # release, not only abort: a stream whose body never started would not close()
            self.aengine.release(self.request)

    @property
    def chain_id(self) -> str | None:
        """The chain the response names (new for open/fork, the same for continue), or None."""
        return self.request.chain_id if self.request is not None else None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    async def deltas(self) -> AsyncIterator[list[Delta]]:
        """Each engine step's deltas (only choices that changed), until every choice is done."""
        assert self.request is not None
        queue = self.request.queue
        while not self.finished:
            outs = [await queue.get()]
            while not queue.empty():
                outs.append(queue.get_nowait())
            step = []
            for out in outs:
                choice = self.choices[out.index]
                if choice.finish_reason is not None:
                    continue  # ended by a stop string; the engine's abort echo comes later
                delta = choice.feed(out)
                if choice.token_gap is not None:
                    self.metrics.observe_token_gap(choice.token_gap)
                if delta.finish_reason is not None:
                    self._on_choice_end(choice)
                step.append(delta)
            if step:
                yield step

    def _on_choice_end(self, choice: Choice) -> None:
        if choice.finish_reason == FINISH_STOP and choice.text.stopped:
            self.aengine.abort(self.request, choice.index)  # the engine does not know stop strings
        self.metrics.observe_sequence(
            arrival=self.request.arrival, first=choice.first_time, last=choice.last_time,
            prompt_tokens=choice.num_prompt_tokens or len(self.prompts[choice.index]),
            cached_tokens=choice.num_cached_tokens, output_tokens=choice.num_output_tokens,
            finish_reason=choice.finish_reason, scheduled=choice.scheduled_time,
        )

    @property
    def failed(self) -> bool:
        return any(c.finish_reason == FINISH_ERROR for c in self.choices)

    def close(self) -> None:
        """Always called when the handler ends: aborts what is left, stops the watcher. A choice
        still running (the client closed a stream) ends here as aborted, counted like any abort."""
        if self._watch is not None:
            self._watch.cancel()
        if self.request is not None:
            self.aengine.release(self.request)
            for choice in self.choices:
                if choice.finish_reason is None:
                    choice.finish_reason = FINISH_ABORT
                    choice.last_time = time.perf_counter()
                    self._on_choice_end(choice)

    def usage(self) -> dict:
        prompt = cached = 0
        seen = set()
        for c in self.choices:
            if c.prompt_index not in seen:
                seen.add(c.prompt_index)
                prompt += c.num_prompt_tokens or len(self.prompts[c.index])
                cached += c.num_cached_tokens
        completion = sum(c.num_output_tokens for c in self.choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }


def _with_seed(p: SamplingParams, seed: int) -> SamplingParams:
    return replace(p, seed=seed if seed <= SEED_MAX else seed - 2**64)
