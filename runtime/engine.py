"""The engine: owns the model, the KV pages, the scheduler and the model runner, and advances all
live requests one step at a time (continuous batching). `LLM` and the server drive it.

The KV method (`method_api.KVMethod`) is resolved from `config.method`, or passed in directly
(tests, and later compiled methods); the engine only talks to it through the contract.

Chains (runtime/chains.py): `add_request(..., chain=ChainSpec(...))` opens, continues or forks a
chain; it validates synchronously and raises the chain errors (404/409/410/503); the returned
sequence carries `chain_id`. A chained request records its KV into its chain when it finishes,
stops or is aborted. `drop_chain` forgets one; `chains.stats()` counts them. `prune_chain` drops
low-value history from an idle chain (runtime/chain_prune.py); with `config.auto_prune`, each chat
turn's end prunes the messages it names.

Clones (`clone_sequence`): a decoding sequence is copied into new running sequences, each with
its own copy of the K/V pages, the scheduler's bookkeeping, the method's per-sequence state
(`Hook.CLONE`) and the sampling generator's state, so every clone continues exactly as the source
would. The throughput benchmark (runtime/bench/) builds its decode batch this way.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import replace
from pathlib import Path

import torch

from kvc.runtime.attention.backend import PagedAttention, class_pages, layer_page_bytes, seq_rows
from kvc.runtime.chain_prune import PruneRequest, Pruner, Scorer, parse_auto_prune, resolve_scorer
from kvc.runtime.chains import ChainSpec, ChainStore
from kvc.runtime.config import DEFAULT_PAGE_SIZE, EngineConfig
from kvc.runtime.context_replay import ContextReplay
from kvc.runtime.errors import (
    ChainCapacity,
    ConfigError,
    InvalidPromptError,
    InvalidSamplingParams,
    KvcError,
    OutOfKVMemory,
    PromptTooLongError,
)
from kvc.runtime.grammar_book import GrammarBook
from kvc.runtime.kv.layout import CacheLayout
from kvc.runtime.kv.page_pool import PagePool
from kvc.runtime.kv.rows import RowPool
from kvc.runtime.kv.spec import LowRank
from kvc.runtime.method_api import Hook, KVMethod
from kvc.runtime.methods import resolve_method
from kvc.runtime.model_runner import ModelRunner
from kvc.runtime.models.loader import LoadedModel, resolve_model
from kvc.runtime.prefill_record import PrefillRecord
from kvc.runtime.sampling_params import SamplingParams
from kvc.runtime.scheduler import Scheduler, SchedulerConfig
from kvc.runtime.sequence import Sequence
from kvc.runtime.text_spans import TextSpans
from kvc.runtime.tuning.lookup import load_for_device as load_tuned_configs

log = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 512 * 2**20


class Engine:
    def __init__(self, config: EngineConfig, method: KVMethod | None = None,
                 loaded: LoadedModel | None = None) -> None:
        """`loaded`: a model already in memory (its weights are shared, never written), for tools
        that build several engines over one model (`kvc eval`); otherwise `config.model` is loaded."""
        self.method = method if method is not None else resolve_method(config.method, config.method_params)
        if config.page_size is None:  # the method's page, else the default (EngineConfig.page_size)
            config = replace(config, page_size=self.method.page_tokens() or DEFAULT_PAGE_SIZE)
        self.config = config
        # the contract's `evict_interval`: before anything sizes memory by the method's budget
        self.method.evict_interval = config.evict_interval
        self.device = config.resolve_device()
        dtype = None if config.dtype == "auto" else config.resolve_dtype(self.device, None)
        self.loaded: LoadedModel = loaded or resolve_model(config.model, self.device, dtype)  # None: the default
        model_ref = str(self.loaded.path or config.model)
        self.model = self.loaded.model
        self.spec = self.model.spec
        self.tokenizer = self.loaded.tokenizer

        self.max_model_len = config.max_model_len or self.spec.max_position_embeddings
        if self.max_model_len > self.spec.max_position_embeddings:
            raise ConfigError(
                f"max_model_len={self.max_model_len} exceeds the model's context "
                f"({self.spec.max_position_embeddings})",
                param="max_model_len",
            )
        # the model's shape, for its budget; its directory, where the method's input tensors are found
        # (or the directory the config names for them)
        inputs_dir = Path(config.method_inputs) if config.method_inputs is not None else self.loaded.path
        self.method.bind(self.spec.num_layers, self.spec.num_kv_heads, model_dir=inputs_dir,
                         max_context=self.max_model_len, num_heads=self.spec.num_heads)
        # the cache's layers: the model's, or one per KV head (runtime/kv/layout.py)
        self.layout = layout = CacheLayout.of(self.spec, self.method)
        # each layer's KV spec: one class of layers mostly, several where the .kvm stores some layers apart
        self.storage = classes = layout.storage(self.spec, self.method, config.page_size)
        specs = classes.specs
        # one layer's page: every per-token tensor of the spec, plus its per-page ones; the rows of
        # its per-sequence tensors (a running sequence's, and an idle chain's) come off the budget first
        class_page_bytes = [layer_page_bytes(s, layout.kv_heads, config.page_size) for s in specs]
        each_row = sum(s.bytes_per_row(layout.kv_heads, layout.layers) for s in specs) \
            if any(s.uses_rows for s in specs) else 0
        num_rows = seq_rows(config.max_num_seqs, each_row, self._kv_budget_bytes())
        if num_rows < 2 * config.max_num_seqs and each_row:
            # rows sized by the longest context (a per-sequence index) would crowd out the pages: fewer
            # rows, and a request waits for one (the rows bound how many sequences run and chains idle)
            log.warning("method %s: %.1f MiB per sequence's row of per-sequence tensors; %d rows (as many "
                        "sequences running or chained at most, max_num_seqs %d)", self.method.name, each_row / 2**20,
                        num_rows, config.max_num_seqs)
        row_bytes = num_rows * each_row
        if row_bytes >= self._kv_budget_bytes():
            raise ConfigError(f"method {self.method.name!r}: {num_rows} rows of per-sequence tensors take "
                              f"{row_bytes} bytes, the whole KV budget; raise kv_cache_memory or lower max_num_seqs "
                              "(or max_model_len, where the method sizes them by the longest context)",
                              param="kv_cache_memory")
        # LAYER tensors (FP8 scales) are stored once, not per page
        fixed_bytes = row_bytes + sum(s.bytes_per_layers(layout.kv_heads, layout.layers) for s in specs)
        # pages per class, so that the classes run out together when every layer stores as many tokens
        self.pages_by_class = class_pages(self._kv_budget_bytes() - fixed_bytes, classes, layout.kv_heads,
                                          config.page_size)
        self.num_pages = sum(self.pages_by_class)
        page_bytes = sum(n * b for n, b in zip(self.pages_by_class, class_page_bytes)) // self.num_pages
        prerope = any(s.prerope for s in specs)
        if prerope and (self.method.compacts or self.method.rewrites or any(s.head_starts for s in specs)):
            raise ConfigError(f"method {self.method.name!r} stores keys before RoPE, each read at its slot's position; "
                              "it cannot also move or drop stored tokens (keeps, rewrites)", param="method")
        if any(s.low_rank and not all(isinstance(e, LowRank) for e in (s.keys, s.values)) for s in specs):
            raise ConfigError(f"method {self.method.name!r}: a low-rank operand needs the other one low-rank too (the "
                              "lowrank kernels read both)", param="method")
        backend = config.attention_backend
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" else "torch"
        if backend == "triton":  # this GPU's `kvc tune` configs (runtime/tuning/); one log line
            load_tuned_configs(self.device)
        self.attention = PagedAttention.allocate(
            num_layers=layout.layers,
            num_pages=self.num_pages,
            num_kv_heads=layout.kv_heads,
            page_size=config.page_size,
            head_dim=self.spec.head_dim,
            dtype=self.spec.dtype,
            device=self.device,
            backend=backend,
            spec=classes,
            num_rows=num_rows,
            num_pages_by_class=self.pages_by_class,
        )
        # LAYER tensors that are the method's input files (low-rank projections), fixed from here on
        for store in self.attention.stores:
            for name, value in self.method.layer_inputs(store.spec, layout.layers, layout.kv_heads).items():
                store[name].copy_(value)
        self.rows = RowPool(num_rows) if num_rows else None
        log.info(
            "KV cache: %d pages of %d tokens (%.1f MiB)%s%s, backend %s",
            self.num_pages, config.page_size, self.num_pages * page_bytes / 2**20,
            f" in {len(specs)} storage classes ({', '.join(map(str, self.pages_by_class))} pages)"
            if len(specs) > 1 else "",
            f" and {num_rows} rows of per-sequence tensors ({row_bytes / 2**20:.1f} MiB)" if num_rows else "", backend,
        )
        method_id = self.method.fingerprint  # name + parameters (+ generated source)
        salt = hashlib.sha256(f"{model_ref}|{method_id}|{self.spec}".encode()).digest()[:16]
        # A compacting method's pages stop matching the logical tokens: no prefix caching for it
        # (its chains still share pages, copy-on-write). Nor for a delta code: a page's codes are
        # relative to centers and sinks its row holds. A spec that writes codes a block at a time
        # shares whole blocks whose codes are written (docs/design.md, "Prefix caching over blocks").
        delta = any(s.delta is not None for s in specs)
        prefix_caching = config.enable_prefix_caching and not self.method.compacts and not delta
        flush_block = self.attention.flush_block
        self.pool = PagePool(self.pages_by_class, config.page_size, prefix_caching, salt=salt,
                             prefix_block=math.lcm(flush_block, config.page_size) if flush_block else 0)
        self.chains = ChainStore(self.pool, layout.layers, self.method, fingerprint=salt.hex(),
                                 rows=self.rows, copy_row=self.attention.copy_rows)
        hooks = self.method.hooks
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_prefill_chunk=config.max_prefill_chunk,
                enable_prefix_caching=prefix_caching,
                prefill_first=config.prefill_first,
            ),
            self.pool,
            num_layers=layout.layers,
            budget=self.method.budget,
            chains=self.chains,
            # may a step write into pages before the newest (copy-on-write of every shared page)?
            compacts=((self.method.compacts or self.method.rewrites) and Hook.PREFILL_END in hooks,
                      (self.method.compacts or self.method.rewrites) and Hook.STEP_END in hooks,
                      self.method.chunk_keeps),
            rows=self.rows,
            residual=self.attention.residual_window,
            window_after=self.attention.window_after,
            layer_class=classes.layer_class,
            flush_block=flush_block,
        )
        self.grammars = GrammarBook(self.tokenizer, self.spec.vocab_size, self.spec.eos_token_ids)
        self.runner = ModelRunner(
            self.model,
            self.attention,
            page_size=config.page_size,
            max_model_len=self.max_model_len,
            max_num_seqs=config.max_num_seqs,
            device=self.device,
            use_cuda_graphs=config.cuda_graphs,
            seed=config.seed,
            method=self.method,
            pool=self.pool,
            grammars=self.grammars,
        )
        if self.method.text_partitions:  # spans of the stored tokens' text (runtime/text_spans.py)
            if self.tokenizer is None:
                raise ConfigError(f"method {self.method.name!r} reads the spans of its tokens' text: the model needs "
                                  "a tokenizer", param="method")
            self.runner.hooks.text_spans = {name: TextSpans(self.tokenizer, markers)
                                            for name, markers in self.method.text_partitions.items()}
        if self.method.replay is not None:  # re-reads each prompt after its prefill (runtime/context_replay.py)
            self.runner.replay = ContextReplay(self.runner, self.method.replay, self.tokenizer)
            self.method.budget.replay_tokens = self.runner.replay.longest
        self.sequences: dict[int, Sequence] = {}
        self.chains.settle = self.runner.hooks.settle
        self.pruner = Pruner(self.chains, self.runner.executors, layout.layers, self.attention.layer_class,
                             self.attention.page_starts)
        self.auto_prune = parse_auto_prune(config.auto_prune) if config.auto_prune else None
        if self.auto_prune is not None:
            try:
                self.pruner.check_prunable()
            except KvcError as e:
                raise ConfigError(f"--auto-prune: method {self.method.name!r}: {e.message}",
                                  param="auto_prune") from None
        self._scorers: dict[str, Scorer] = {}
        self.runner.chain_window = self._chain_window()
        # Async scheduling (`step`): on by default on a GPU, decode-time eviction included (its
        # step_end reads host facts only; its compactions queue behind the launched step).
        self._async = config.async_scheduling if config.async_scheduling is not None else self.device.type == "cuda"
        self._launched: tuple | None = None  # (batch, StepOutput) running ahead of its commit
        self._drained: list[Sequence] = []  # finished by a `drain`, reported by the next step

    def _kv_budget_bytes(self) -> int:
        if self.config.kv_cache_memory is not None:
            return self.config.kv_cache_memory
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            # leave room for activations of one full step and CUDA graphs
            return int(free * self.config.gpu_memory_utilization)
        return CPU_DEFAULT_KV_BYTES

    # ---- requests --------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    chain: ChainSpec | None = None, record: PrefillRecord | None = None,
                    replay: PrefillRecord | None = None) -> Sequence:
        """Queues a request; raises the user's errors at once (and the chain errors for `chain`).
        `record`: capture this request's prefill into it; `replay`: take the prefill from a record
        of the same prompt instead of running the model (runtime/prefill_record.py)."""
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidPromptError("the prompt is empty; give at least one token", param="prompt")
        if n >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {n} tokens, but the model's context is {self.max_model_len} tokens "
                f"(prompt plus at least one new token must fit)",
                param="prompt",
            )
        vocab = self.spec.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise InvalidPromptError(f"prompt token ids must be in [0, {vocab})", param="prompt")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise InvalidSamplingParams(f"logit_bias: token ids must be in [0, {vocab})", param="logit_bias")
        if params.prompt_logprobs is not None and (replay is not None or (chain is not None and not chain.open)):
            raise InvalidSamplingParams("prompt_logprobs: a chain continuation or a replayed prefill does not run "
                                        "the model over the whole prompt", param="prompt_logprobs")
        if (record is not None or replay is not None) and not self.shares_prefills:
            why = ("cuts its cache after every prefill chunk" if self.method.chunk_keeps else
                   "stores K/V in a format its prefill attention reads back")
            raise ConfigError(f"method {self.method.name!r} {why}, so its forward is its own: it neither records nor "
                              "replays prefills", param="replay")
        if self.method.replay is not None and chain is not None and not chain.open:
            raise ConfigError(f"method {self.method.name!r} re-reads the whole stored prompt after its prefill; a "
                              "chain continuation prefills only its suffix", param="chain")
        if replay is not None:
            if chain is not None and not chain.open:
                raise ConfigError("replay: a recorded prefill starts at the prompt's first token; a chain "
                                  "continuation prefills only its suffix", param="replay")
            if not replay.complete or list(replay.tokens) != list(prompt_token_ids):
                raise InvalidPromptError("replay: the prefill record is incomplete or of another prompt",
                                         param="replay")
        matcher = None  # compiled before the request is queued: a bad grammar is refused whole
        if params.structured_outputs is not None:
            matcher = self.grammars.matcher(params.structured_outputs.to_grammar())
        seq = Sequence(
            prompt_token_ids,
            params=params,
            eos_token_ids=self.spec.eos_token_ids,
            max_model_len=self.max_model_len,
            num_layers=self.layout.layers,
        )
        if record is not None:
            record.start(prompt_token_ids, self.layout.layers)
        seq.record, seq.replay = record, replay
        if chain is None:
            self._check_fits(seq, params)
            self.scheduler.add(seq)
        else:
            record = self.chains.begin(chain, prompt_token_ids)
            seq.chain, seq.chain_id = record, record.chain_id
            seq.segments = chain.segments
            try:
                self._check_fits(seq, params)
                self.scheduler.add(seq)
            except BaseException as e:
                self.chains.abandon(record, chain)
                if not (chain.auto and isinstance(e, ChainCapacity)):
                    raise
                # an automatic chain never fails a request that would run without one
                seq.chain = seq.chain_id = seq.segments = None
                self._check_fits(seq, params)
                self.scheduler.add(seq)
        self.runner.add_request(seq.seq_id, params.seed)
        if matcher is not None:
            self.grammars.add(seq.seq_id, matcher)
        self.sequences[seq.seq_id] = seq
        return seq

    def _check_fits(self, seq: Sequence, params: SamplingParams) -> None:
        """OutOfKVMemory when the request can never fit the pool; ChainCapacity when a chained one
        cannot fit beside the pages active chains pin (idle ones would be evicted)."""
        physical = seq.physical_prompt_len  # a continuation counts its stored history, not its logical one
        grown = physical + min(params.max_tokens, self.max_model_len - len(seq.token_ids))
        needed = self.scheduler.pages_needed_by_class(physical, grown)
        sizes = self.pool.sizes
        c = self.pool.oversized(needed)
        if c is not None:
            where = f" of storage class {c}" if len(sizes) > 1 else ""
            raise OutOfKVMemory(
                f"the request needs {needed[c]} KV pages{where} but the whole pool has {sizes[c]}; "
                f"raise kv_cache_memory or lower max_tokens",
            )
        if seq.chain is not None:
            # the record's pages stay pinned for the turn; a compacting turn may copy all of them,
            # otherwise only each layer's partial last page is copied
            compacts = self.scheduler.compacts_prefill or self.scheduler.compacts_decode
            copies = (self.pool.count_by_class(seq.chain.pages()) if compacts
                      else self.scheduler.by_class([1] * self.layout.layers))
            pinned = self.chains.pinned_pages(exclude=seq.chain)
            for need, copy, pin, size in zip(needed, copies, pinned, sizes):
                if need + copy + pin > size:
                    raise ChainCapacity(
                        f"the chain's request needs {need + copy} KV pages, {pin} of the pool's {size} "
                        "are held by other active chains; retry later", param="chain_id")

    def clone_sequence(self, seq: Sequence, count: int) -> list[Sequence]:
        """`count` new running sequences, each a copy of the decoding `seq` (its tokens, its K/V in
        pages of its own, the method's state, the sampling generator's state). Refused whole with
        OutOfKVMemory when the free pages do not cover them, ConfigError past max_num_seqs."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ConfigError(f"clone count must be a non-negative integer, got {count!r}", param="count")
        self.drain()
        clones = [
            Sequence(seq.token_ids[: seq.num_prompt_tokens], params=seq.params, eos_token_ids=seq.eos_token_ids,
                     max_model_len=seq.max_model_len, num_layers=self.layout.layers)
            for _ in range(count)
        ]
        pairs = self.scheduler.clone(seq, clones)
        self.attention.copy_pages([src for src, _ in pairs], [dst for _, dst in pairs])
        if seq.row is not None:
            self.attention.copy_rows([seq.row] * len(clones), [clone.row for clone in clones])
        source_generator = self.runner.generators.get(seq.seq_id)
        for clone in clones:
            if Hook.CLONE in self.method.hooks:
                self.method.clone(seq.seq_id, clone.seq_id)
            self.runner.add_request(clone.seq_id, None if source_generator is None else 0)
            if source_generator is not None:  # the clone draws what the source would
                self.runner.generators[clone.seq_id].set_state(source_generator.get_state())
            self.grammars.copy(seq.seq_id, clone.seq_id)
            clone.logprobs = None if seq.logprobs is None else list(seq.logprobs)
            clone.prompt_logprobs = None if seq.prompt_logprobs is None else list(seq.prompt_logprobs)
            self.sequences[clone.seq_id] = clone
        return clones

    def drop_chain(self, chain_id: str, owner: str | None) -> None:
        """Forgets a chain and frees its pages (ChainNotFound / ChainEvicted / ChainBusy)."""
        self.chains.drop(chain_id, owner)

    def prune_chain(self, chain_id: str, owner: str | None, request: PruneRequest) -> dict:
        """Prunes an idle chain's history (runtime/chain_prune.py); its report as a dict. Raises the
        chain errors, InvalidPrune for a request that names nothing prunable."""
        record = self.chains.get(chain_id, owner)
        self.pruner.check_prunable()
        report = self.pruner.prune(record, request, self._scorer(request))
        return {"id": chain_id, **report.as_dict()}

    def _scorer(self, request: PruneRequest) -> Scorer:
        key = json.dumps([request.scorer, request.scorer_params], sort_keys=True, default=repr)
        scorer = self._scorers.get(key)
        if scorer is None:
            scorer = self._scorers[key] = resolve_scorer(request, self.method, self.config.prune_scorer)
        return scorer

    def _chain_window(self) -> int:
        """Prefill queries a chained turn keeps per layer: the default prune scorer's observation
        window (`config.chain_queries` for one reading every query; 0 without a default scorer)."""
        try:
            scorer = resolve_scorer(PruneRequest(roles=("tool",), keep=0.0), self.method, self.config.prune_scorer)
        except KvcError:  # the served method scores no tokens and no --prune-scorer names one
            return 0
        window = scorer.query_window
        return self.config.chain_queries if window < 0 else window

    def _auto_prune(self, seq: Sequence) -> None:
        """The server's automatic prune of a chain whose chat turn just ended (once per message)."""
        record = seq.chain
        if record is None or record.segments is None or record.chain_id not in self.chains:
            return
        try:
            self.pruner.prune(record, self.auto_prune, self._scorer(self.auto_prune))
        except KvcError as e:  # e.g. no page for a copy-on-write: the chain stays as it was
            log.warning("automatic prune of chain %s skipped: %s", record.chain_id, e.message)

    def chain_info(self, chain_id: str, owner: str | None) -> dict:
        """A chain's tokens, state (active/idle), last use (unix time) and pages held."""
        return self.chains.info(chain_id, owner)

    def list_chains(self, owner: str | None) -> list[dict]:
        """`chain_info` of each of the owner's chains, with its id, most recently used first."""
        return self.chains.owned(owner)

    def abort(self, seq_id: int) -> None:
        self.scheduler.abort(seq_id)
        self._release(seq_id)
        self.sequences.pop(seq_id, None)

    @property
    def shares_prefills(self) -> bool:
        """Whether this engine's prefill forward is every method's (runtime/prefill_record.py), so it
        may record prefills and replay others': not when its method cuts the cache while prefilling,
        nor when K/V are stored in a format attention reads back (quantized: earlier chunks, and
        without a residual window the chunk itself, are read as stored)."""
        return not self.method.chunk_keeps and all(s.spec.dense for s in self.attention.stores)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._launched is not None or bool(self._drained)

    def step(self) -> list[Sequence]:
        """One engine step; returns the sequences that finished in it.

        Async scheduling: a plain decode step is left running on the device (`_launched`); the
        next call schedules and launches the step after it over its pending tokens, and only then
        waits for its tokens and commits them. The host's work for a step so overlaps the
        device's previous one. A step that cannot be scheduled ahead (a request waits, a prefill,
        a chain, structured outputs, pages short) is run the plain way, after a commit."""
        finished, self._drained = self._drained, []
        launched, self._launched = self._launched, None
        if launched is not None:
            batch, out = launched
            ahead = self.scheduler.schedule_ahead(batch)
            if ahead is not None:
                ahead_out = self.runner.run(ahead, ahead.needs_sample(), out, defer=True)
                finished += self._commit(batch, out)
                self.scheduler.advance(ahead, ahead_out.compacted, ahead_out.rewritten)
                self._launched = (ahead, ahead_out)
                return finished
            finished += self._commit(batch, out)  # then this call's step, scheduled the plain way
        batch = self.scheduler.schedule()
        if batch is None:
            return finished
        overlap = self._async and self.scheduler.may_run_ahead(batch)
        out = self.runner.run(batch, batch.needs_sample(), defer=overlap)
        self.scheduler.advance(batch, out.compacted, out.rewritten)
        if overlap:
            self._launched = (batch, out)
            return finished
        return finished + self._commit(batch, out)

    def _commit(self, batch, out) -> list[Sequence]:
        """Appends an advanced step's tokens and logprobs (waiting for them); the sequences that
        finished."""
        sampled = out.resolve()
        if self.grammars.matchers:
            self.grammars.advance(sampled)
        for seq_id, (first, entries) in out.prompt_logprobs.items():
            if seq_id in self.sequences:
                self.sequences[seq_id].add_prompt_logprobs(first, entries)
        finished = self.scheduler.commit(batch, sampled, out.logprobs)
        for seq in finished:  # step_end (decode-time eviction) ran in the runner, before the commit
            self._release(seq.seq_id)
            if self.auto_prune is not None:
                self._auto_prune(seq)
        return finished

    def drain(self) -> None:
        """Commits the step left running (async scheduling), so every sequence's tokens are on the
        host; what finished is reported by the next `step()`."""
        launched, self._launched = self._launched, None
        if launched is not None:
            self._drained += self._commit(*launched)

    def _release(self, seq_id: int) -> None:
        self.runner.remove_request(seq_id)
        self.grammars.remove(seq_id)
        self.sequences.pop(seq_id, None)
        if Hook.RELEASE in self.method.hooks:
            self.method.release(seq_id)
