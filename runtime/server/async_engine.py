"""The engine behind the server: one thread owns the `Engine`; asyncio handlers talk to it.

The engine is not thread-safe, so exactly one thread touches it. Handlers (on the event loop) send
commands through a thread-safe queue: add a group of sequences (one HTTP request: prompts x n),
abort a group, call an engine method (drop a chain, describe one), stop. The engine thread runs
commands between steps, steps while there is work and blocks on the queue when idle. After each
step it posts every request's new tokens back to the loop in one `call_soon_threadsafe`, into the
request's asyncio queue. With chain limits (a TTL), the thread also wakes while idle to drop
expired chains.

    handler ──submit()──► commands ──► engine thread: add_request / abort / step ──┐
    handler ◄── Request.queue ◄── loop.call_soon_threadsafe(deliver, outputs) ◄────┘
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvc.runtime.chains import ChainSpec
from kvc.runtime.engine import Engine
from kvc.runtime.sampling_params import SamplingParams
from kvc.runtime.sequence import FINISH_ABORT, Sequence, SequenceStatus
from kvc.runtime.server.errors import EngineUnavailable, ServerBusy

log = logging.getLogger(__name__)

FINISH_ERROR = "error"  # the engine failed while running the request (a bug; logged)
_SWEEP_SECONDS = 0.5  # how often expired chains are looked for (ChainStore.expire)


@dataclass
class Output:
    """New tokens of one sequence of a request, from one engine step."""

    index: int  # which sequence of the request (prompt i, sample j -> i * n + j)
    token_ids: list[int]
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    time: float = 0.0  # time.perf_counter() when the step ended
    logprobs: list | None = None  # one TokenLogprobs per token of `token_ids`, when the request asked
    prompt_logprobs: list | None = None  # with a sequence's first output, when the request asked
    stop_reason: int | None = None  # the stop token id that ended the sequence
    scheduled: float | None = None  # perf_counter() at the start of the step that first admitted it


@dataclass(eq=False)  # identity: requests live in sets
class Request:
    """A group of sequences submitted together, as the event loop sees it."""

    arrival: float
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # of list[Output]
    seq_ids: list[int] = field(default_factory=list)
    num_unfinished: int = 0
    chain_id: str | None = None  # set when the engine accepted a chained request


@dataclass(frozen=True)
class EngineStats:
    """A snapshot the engine thread publishes after each step, for /metrics and /health."""

    num_running: int = 0
    num_waiting: int = 0
    pages_used: int = 0
    pages_free: int = 0
    pages_total: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    chains_active: int = 0  # chain cache (ChainStore.stats())
    chains_idle: int = 0
    chains_evicted_total: int = 0
    chains_expired_total: int = 0
    chain_pages: int = 0
    chain_prunes_total: int = 0
    chain_pruned_tokens_total: int = 0
    # per method (Engine.lane_stats): its key, requests, prompt tokens, generated tokens, running, KV pages
    methods: tuple[dict, ...] = ()


@dataclass
class _Live:
    request: Request
    index: int
    seq: Sequence
    sent: int = 0
    scheduled: float | None = None


class AsyncEngine:
    def __init__(self, engine: Engine, max_waiting: int = 1024) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.stats = EngineStats(pages_total=engine.num_pages, pages_free=engine.pool.num_free)
        self.active: set[Request] = set()  # requests whose handler is still running
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[int, _Live] = {}  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._idle: asyncio.Event | None = None
        self._num_steps = 0
        self._last_sweep = 0.0
        self.failure: str | None = None  # set when the engine thread died: no request may wait on it
        # called on the engine thread with the tokens of each step that ran (metrics: tokens per step)
        self.on_step: Callable[[int], None] | None = None

    # ---- event-loop side ----------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._idle = asyncio.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name="kvc-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Aborts whatever is left and ends the engine thread."""
        if self._thread is None:
            return
        self._commands.put(("stop",))
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    def stop_soon(self) -> None:
        """Asks the engine thread to abort what is left and end, without waiting for it."""
        self._commands.put(("stop",))

    async def submit(self, prompts: list[list[int]], params: list[SamplingParams],
                     chain: ChainSpec | None = None) -> Request:
        """Queues one sequence per (prompt, params) pair; raises the engine's KvcError if any is
        rejected (then none is queued). A chained request is one sequence."""
        assert self._loop is not None, "AsyncEngine.start() was not called"
        assert chain is None or len(prompts) == 1, "a chained request has exactly one sequence"
        if self.failure is not None:
            raise self._unavailable()
        request = Request(arrival=time.perf_counter())
        done = self._loop.create_future()
        self._commands.put(("add", request, prompts, params, chain, done))
        if self.failure is not None:  # the thread died between the check above and the put
            self._fail_queued()
        self.active.add(request)
        self._idle.clear()
        try:
            await done
        except BaseException:
            self.release(request)  # cancelled (client gone) or rejected: nothing may stay queued
            raise
        return request

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Runs `fn(engine)` on the engine thread between steps; returns its result or raises its
        exception (a KvcError for the client)."""
        assert self._loop is not None, "AsyncEngine.start() was not called"
        if self.failure is not None:
            raise self._unavailable()
        done = self._loop.create_future()
        self._commands.put(("call", fn, done))
        if self.failure is not None:
            self._fail_queued()
        return await done

    def abort(self, request: Request, index: int | None = None) -> None:
        """Ends the request's unfinished sequences (or only sequence `index`); their pages are
        freed at the engine thread's next command pass."""
        if request.num_unfinished:
            self._commands.put(("abort", request, index))

    def release(self, request: Request) -> None:
        """The handler is done with the request: abort what is left, stop counting it as active."""
        self.abort(request)
        self.active.discard(request)
        if not self.active:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Waits until no request is active; False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def _unavailable(self) -> EngineUnavailable:
        # the failure's type and text stay in the server log (they name internals)
        why = "it was stopped" if self.failure == "stopped" else "it failed; see the server log"
        return EngineUnavailable(f"the engine is not running ({why})")

    def abort_all(self) -> None:
        for request in list(self.active):
            self.abort(request)

    def _deliver(self, outputs: list[tuple[Request, Output]]) -> None:
        for request, out in outputs:
            if out.finish_reason is not None:
                request.num_unfinished -= 1
            request.queue.put_nowait(out)

    def _resolve(self, request: Request, done: asyncio.Future, seq_ids: list[int], error,
                 chain_id: str | None = None) -> None:
        request.seq_ids = seq_ids
        request.num_unfinished = len(seq_ids)
        request.chain_id = chain_id
        if done.cancelled():
            self.abort(request)
        elif error is not None:
            done.set_exception(error)
        else:
            done.set_result(None)

    # ---- engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            if self.engine.device.type == "cuda":
                torch.cuda.set_device(self.engine.device)  # the current device is per thread
            while True:
                if not self.engine.has_unfinished():
                    self._publish()
                    if not self._handle(self._wait_for_command()):  # idle: block until work comes
                        return
                while True:
                    try:
                        command = self._commands.get_nowait()
                    except queue.Empty:
                        break
                    if not self._handle(command):
                        return
                if self.engine.has_unfinished():
                    self._step()
                self._sweep()
        except BaseException as e:
            self.failure = f"{type(e).__name__}: {e}"
            log.exception("the engine thread failed; failing every request from now on")
            raise
        finally:  # stopped (or crashed): no handler may wait forever
            reason = FINISH_ERROR if self.failure is not None else FINISH_ABORT
            if self.failure is None:
                self.failure = "stopped"
            self._fail_queued()
            outputs: list[tuple[Request, Output]] = []
            for seq_id in list(self._live):
                self._abort_seq(seq_id, outputs, reason)
            try:
                self._post(outputs)
            except RuntimeError:  # the event loop is already closed
                pass
            try:
                self._publish()
            except Exception:  # best effort: the gauges are all that is lost
                log.exception("publishing the final engine stats failed")

    def _fail_queued(self) -> None:
        """Answers every command still queued, so no submitter waits on a thread that is gone."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            error = self._unavailable()
            try:
                if command[0] == "add":
                    request, done = command[1], command[5]
                    self._loop.call_soon_threadsafe(self._resolve, request, done, [], error)
                elif command[0] == "call":
                    self._loop.call_soon_threadsafe(_settle, command[2], None, error)
            except RuntimeError:  # the event loop is already closed
                return

    def _wait_for_command(self) -> tuple:
        """The next command; with a chain TTL, idle chains still expire while none comes."""
        while True:
            ttl = self.engine.chains.limits.ttl
            try:
                return self._commands.get(timeout=None if ttl is None else min(ttl, _SWEEP_SECONDS))
            except queue.Empty:
                self._sweep()

    def _sweep(self) -> None:
        """Drops the chains the chain limits no longer allow (at most every _SWEEP_SECONDS)."""
        now = time.monotonic()
        if now - self._last_sweep >= _SWEEP_SECONDS:
            self._last_sweep = now
            if self.engine.expire_chains():
                self._publish()

    def _handle(self, command: tuple) -> bool:
        kind = command[0]
        if kind == "add":
            self._add(*command[1:])
        elif kind == "abort":
            request, index = command[1], command[2]
            outputs: list[tuple[Request, Output]] = []
            for i, seq_id in enumerate(request.seq_ids):
                if seq_id in self._live and index in (None, i):
                    self._abort_seq(seq_id, outputs, FINISH_ABORT)
            self._post(outputs)
        elif kind == "call":
            fn, done = command[1], command[2]
            result = error = None
            try:
                result = fn(self.engine)
            except Exception as e:  # a KvcError for the client; anything else is a bug, reported as 500
                error = e
            self._loop.call_soon_threadsafe(_settle, done, result, error)
            self._publish()  # e.g. a dropped chain shows in the gauges at once
        elif kind == "stop":
            return False
        return True

    def _add(self, request: Request, prompts, params, chain: ChainSpec | None, done) -> None:
        engine = self.engine
        seqs: list[Sequence] = []
        error = None
        try:
            if engine.scheduler.num_waiting + len(prompts) > self.max_waiting:
                raise ServerBusy(
                    f"the server's waiting queue is full ({self.max_waiting} requests); retry later"
                )
            for ids, p in zip(prompts, params):
                # only chained requests pass `chain`: plain ones call the engine as they always did
                seqs.append(engine.add_request(ids, p) if chain is None else engine.add_request(ids, p, chain=chain))
        except Exception as e:  # a KvcError for bad input; anything else is a bug, reported as 500
            error = e
            for seq in seqs:
                engine.abort(seq.seq_id)
            seqs = []
        for index, seq in enumerate(seqs):
            self._live[seq.seq_id] = _Live(request, index, seq)
        chain_id = seqs[0].chain_id if chain is not None and seqs else None
        self._loop.call_soon_threadsafe(self._resolve, request, done, [s.seq_id for s in seqs], error, chain_id)

    def _abort_seq(self, seq_id: int, outputs: list, reason: str) -> None:
        live = self._live.pop(seq_id)
        try:
            self.engine.abort(seq_id)
        except Exception:  # the engine's books are already broken; keep the server answering
            log.exception("aborting sequence %d failed", seq_id)
        outputs.append((live.request, self._output(live, reason)))

    def _output(self, live: _Live, reason: str | None) -> Output:
        seq = live.seq
        new = seq.token_ids[seq.num_prompt_tokens + live.sent :]
        logprobs = None if seq.logprobs is None else seq.logprobs[live.sent : live.sent + len(new)]
        prompt_logprobs = seq.prompt_logprobs if live.sent == 0 else None
        live.sent += len(new)
        return Output(live.index, new, reason, seq.num_prompt_tokens, seq.num_cached_tokens, time.perf_counter(),
                      logprobs, prompt_logprobs, seq.stop_reason, live.scheduled)

    def _step(self) -> None:
        outputs: list[tuple[Request, Output]] = []
        start, scheduled_before = time.perf_counter(), self.engine.scheduler.num_scheduled_tokens
        try:
            finished = {seq.seq_id for seq in self.engine.step()}
        except Exception:
            log.exception("engine step failed; aborting all %d running requests", len(self._live))
            for seq_id in list(self._live):
                self._abort_seq(seq_id, outputs, FINISH_ERROR)
            self._post(outputs)
            return
        self._num_steps += 1
        tokens = self.engine.scheduler.num_scheduled_tokens - scheduled_before
        if tokens and self.on_step is not None:
            self.on_step(tokens)
        for seq_id, live in list(self._live.items()):
            if live.scheduled is None and live.seq.status is not SequenceStatus.WAITING:
                live.scheduled = start
            if seq_id in finished:
                del self._live[seq_id]
                outputs.append((live.request, self._output(live, live.seq.finish_reason)))
            elif len(live.seq.token_ids) - live.seq.num_prompt_tokens > live.sent:
                outputs.append((live.request, self._output(live, None)))
        self._publish()
        self._post(outputs)

    def _post(self, outputs: list[tuple[Request, Output]]) -> None:
        if outputs:
            self._loop.call_soon_threadsafe(self._deliver, outputs)

    def _publish(self) -> None:
        engine = self.engine
        pool, sched = engine.pool, engine.scheduler
        prefix = pool.stats()
        chains = engine.chains.stats()
        self.stats = EngineStats(
            num_running=sched.num_running,
            num_waiting=sched.num_waiting,
            pages_used=pool.num_used,
            pages_free=pool.num_free,
            pages_total=pool.num_pages,
            prefix_query_tokens=int(prefix["query_tokens"]),
            prefix_hit_tokens=int(prefix["hit_tokens"]),
            num_preemptions=sched.num_preemptions,
            num_steps=self._num_steps,
            chains_active=int(chains.get("active", 0)),
            chains_idle=int(chains.get("idle", 0)),
            chains_evicted_total=int(chains.get("evicted_total", 0)),
            chains_expired_total=int(chains.get("expired_total", 0)),
            chain_pages=int(chains.get("pages", 0)),
            chain_prunes_total=int(chains.get("prunes_total", 0)),
            chain_pruned_tokens_total=int(chains.get("pruned_tokens_total", 0)),
            methods=tuple(engine.lane_stats()),
        )


def _settle(done: asyncio.Future, result, error) -> None:
    """Completes a `call` future on the event loop (unless its caller has gone)."""
    if done.cancelled():
        return
    if error is not None:
        done.set_exception(error)
    else:
        done.set_result(result)
