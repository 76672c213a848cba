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

import json
import logging
import math
from dataclasses import replace
from functools import cached_property, partial
from pathlib import Path

import torch

from kvc.runtime.attention.backend import PagedAttention, layer_page_bytes, load_ops, seq_rows
from kvc.runtime.chain_prune import PruneRequest, Pruner, Scorer, parse_auto_prune, resolve_scorer
from kvc.runtime.chains import ChainLimits, ChainSpec, ChainStore
from kvc.runtime.config import DEFAULT_PAGE_SIZE, EngineConfig
from kvc.runtime.context_replay import ContextReplay
from kvc.runtime.distributed.group import HeadCollective, TPGroup
from kvc.runtime.distributed.shard import shard_model
from kvc.runtime.distributed.workers import launch as launch_followers
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
from kvc.runtime.host_ranges import host_range
from kvc.runtime.kv.layout import CacheLayout
from kvc.runtime.kv.page_pool import PagePool
from kvc.runtime.kv.rows import RowPool
from kvc.runtime.kv.spec import LowRank, StorageClasses
from kvc.runtime.kv.store import KVStore
from kvc.runtime.lanes import (MAX_REQUEST_LANES, Lane, PoolClasses, lane_rules, method_fingerprint, pool_pages,
                               requested, storage_salt)
from kvc.runtime.method_api import Hook, KVMethod
from kvc.runtime.methods import resolve_method
from kvc.runtime.model_runner import ModelRunner
from kvc.runtime.models.loader import LoadedModel, resolve_model
from kvc.runtime.prefill_record import PrefillRecord
from kvc.runtime.primitives.torch_primitives import ranks_scope
from kvc.runtime.sampling_params import SamplingParams
from kvc.runtime.scheduler import Scheduler, SchedulerConfig
from kvc.runtime.sequence import Sequence
from kvc.runtime.spec_group import SpecGroup, shares_attention, variants_of
from kvc.runtime.step_hooks import StepHooks
from kvc.runtime.text_spans import TextSpans
from kvc.runtime.tuning.lookup import load_for_device as load_tuned_configs

log = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 512 * 2**20


class Engine:
    def __init__(self, config: EngineConfig, method: KVMethod | None = None,
                 loaded: LoadedModel | None = None, tp: TPGroup | None = None) -> None:
        """`loaded`: a model already in memory (its weights are shared, never written), for tools
        that build several engines over one model (`kvc eval`); otherwise `config.model` is loaded.
        `config.methods` names more methods to serve beside the default one (runtime/lanes.py).
        `config.tensor_parallel_size` > 1: this engine leads that many ranks, spawning the others
        (runtime/distributed/); `tp`: a follower rank's group (workers.py builds those)."""
        self.tp, self._followers = tp, []
        if config.tensor_parallel_size > 1 and tp is None:
            if loaded is not None:
                raise ConfigError("an engine over a model already loaded runs on one rank",
                                  param="tensor_parallel_size")
            self._followers, init = launch_followers(config)
            try:
                self.tp = TPGroup.join(0, config.tensor_parallel_size, init, config.resolve_device())
            except BaseException:
                for proc in self._followers:
                    proc.kill()
                raise
        try:
            self._build(config, method, loaded)
        except BaseException:
            for proc in self._followers:  # a leader that fails leaves no follower waiting for it
                proc.kill()
            if self.tp is not None:
                self.tp.close()
            raise

    def _build(self, config: EngineConfig, method: KVMethod | None, loaded: LoadedModel | None) -> None:
        given = dict(config.methods_params or {})  # per method name; the default's are under method_params too
        if method is None:
            method = resolve_method(config.method, {**given.get(config.method, {}), **(config.method_params or {})}
                                    or None)
        self.method = method
        self._sources = {self.method.name: config.method}  # what each loaded method was resolved from
        extra = []
        for spec in dict.fromkeys(config.methods or ()):
            m = resolve_method(spec, given.get(spec))
            if m.name not in self._sources:
                self._sources[m.name] = spec
                extra.append(m)
        methods = [self.method, *extra]
        if config.page_size is None:  # the methods' page, else the default (EngineConfig.page_size)
            pages = {m.page_tokens() for m in methods} - {None}
            if len(pages) > 1:
                raise ConfigError(f"methods {', '.join(m.name for m in methods)} ask for pages of {sorted(pages)} "
                                  "tokens; serve them on engines of their own", param="methods")
            config = replace(config, page_size=pages.pop() if pages else DEFAULT_PAGE_SIZE)
        self.config = config
        self.device = config.resolve_device()
        dtype = None if config.dtype == "auto" else config.resolve_dtype(self.device, None)
        # this rank's heads and columns of the model (runtime/distributed/shard.py); None: one rank. A
        # checkpoint is cut before it is read (each rank loads its part alone); a model in memory after
        self.shards = None
        cut = None if self.tp is None else self._cut
        self.loaded: LoadedModel = loaded or resolve_model(config.model, self.device, dtype, cut)  # None: the default
        self.model_ref = str(self.loaded.path or config.model)
        self.model = self.loaded.model
        if self.tp is not None and self.shards is None:
            self._cut(self.model)
        self.spec = self.model.spec
        self.tokenizer = self.loaded.tokenizer

        self.max_model_len = config.max_model_len or self.spec.max_position_embeddings
        if self.max_model_len > self.spec.max_position_embeddings:
            raise ConfigError(
                f"max_model_len={self.max_model_len} exceeds the model's context "
                f"({self.spec.max_position_embeddings})",
                param="max_model_len",
            )
        for m in methods:
            self._bind(m)
        # the cache's layers: the model's, or one per KV head (runtime/kv/layout.py)
        self.layout = layout = CacheLayout.of(self.spec, self.method)
        for m in extra:
            if CacheLayout.of(self.spec, m) != layout:
                raise ConfigError(f"methods {self.method.name!r} and {m.name!r} lay the cache out differently (one "
                                  "cache layer per KV head or per model layer); serve them on engines of their own",
                                  param="methods")
        # each lane's per-layer KV specs, over the pool's storage classes (equal specs: one class)
        self.pool_classes = pool_classes = PoolClasses()
        storages = [layout.storage(self.spec, m, config.page_size) for m in methods]
        lane_classes = [pool_classes.classes_of(st, getattr(m, "layer_digest", ""))
                        for st, m in zip(storages, methods)]
        specs = pool_classes.specs
        # one layer's page: every per-token tensor of the spec, plus its per-page ones; the rows of
        # its per-sequence tensors (a running sequence's, and an idle chain's) come off the budget first
        each_row = sum(s.bytes_per_row(layout.kv_heads, layout.layers) for s in specs) \
            if any(s.uses_rows for s in specs) else 0
        budget = self._kv_budget_bytes()
        num_rows = seq_rows(config.max_num_seqs, each_row, budget)
        if num_rows < 2 * config.max_num_seqs and each_row:
            # rows sized by the longest context (a per-sequence index) would crowd out the pages: fewer
            # rows for idle chains (admission evicts one for a row), or fewer than max_num_seqs, and a
            # request waits for one (the rows bound how many sequences run and chains idle)
            owners = ", ".join(m.name for m, classes in zip(methods, lane_classes)
                               if any(specs[c].uses_rows for c in set(classes)))
            (log.warning if num_rows < config.max_num_seqs else log.info)(
                "method %s: %.1f MiB per sequence's row of per-sequence tensors; %d rows (as many sequences "
                "running or chained at most, max_num_seqs %d)", owners, each_row / 2**20, num_rows,
                config.max_num_seqs)
        row_bytes = num_rows * each_row
        if row_bytes >= budget:
            raise ConfigError(f"method {self.method.name!r}: {num_rows} rows of per-sequence tensors take "
                              f"{row_bytes} bytes, the whole KV budget; raise kv_cache_memory or lower max_num_seqs "
                              "(or max_model_len, where the method sizes them by the longest context)",
                              param="kv_cache_memory")
        # LAYER tensors (FP8 scales) are stored once, not per page
        fixed_bytes = row_bytes + sum(s.bytes_per_layers(layout.kv_heads, layout.layers) for s in specs)
        # pages per class: each lane's share of the budget over its own classes, so that they run out
        # together when every layer stores as many tokens; lanes sharing a class pool their shares
        self.pages_by_class = pool_pages(budget - fixed_bytes, storages, lane_classes, len(specs),
                                         layout.kv_heads, config.page_size)
        self.num_pages = sum(self.pages_by_class)
        class_page_bytes = [layer_page_bytes(s, layout.kv_heads, config.page_size) for s in specs]
        page_bytes = sum(n * b for n, b in zip(self.pages_by_class, class_page_bytes)) // self.num_pages
        for m, storage in zip(methods, storages):
            _check_storage(m, storage)
        backend = config.attention_backend
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" else "torch"
        if backend == "triton":  # this GPU's `kvc tune` configs (runtime/tuning/); one log line
            load_tuned_configs(self.device)
        load_ops(backend, self.device)  # a bad backend fails before the pool is allocated
        self.stores = [KVStore(s, n, layout.kv_heads, config.page_size, layout.layers, self.device, num_rows)
                       for s, n in zip(specs, self.pages_by_class)]
        # LAYER tensors that are the methods' input files (low-rank projections), fixed from here on
        for m, classes in zip(methods, lane_classes):
            for c in sorted(set(classes)):
                for name, value in m.layer_inputs(self.stores[c].spec, layout.layers, layout.kv_heads).items():
                    self.stores[c][name].copy_(value)
        self.rows = RowPool(num_rows) if num_rows else None
        log.info(
            "KV cache: %d pages of %d tokens (%.1f MiB)%s%s, backend %s%s",
            self.num_pages, config.page_size, self.num_pages * page_bytes / 2**20,
            f" in {len(specs)} storage classes ({', '.join(map(str, self.pages_by_class))} pages)"
            if len(specs) > 1 else "",
            f" and {num_rows} rows of per-sequence tensors ({row_bytes / 2**20:.1f} MiB)" if num_rows else "", backend,
            f", methods {', '.join(m.name for m in methods)}" if extra else "",
        )
        self.backend = backend
        self.lanes: list[Lane] = [self._lane(m, {}, storage, classes)
                                  for m, storage, classes in zip(methods, storages, lane_classes)]
        self.default_lane = self.lanes[0]
        self.attention = self.default_lane.attention
        self.storage = storages[0]
        prefix_caching = any(lane.rules.prefix_caching for lane in self.lanes)
        flush_block = math.lcm(*(lane.rules.flush_block or 1 for lane in self.lanes))
        flush_block = 0 if flush_block == 1 else flush_block
        self.pool = PagePool(self.pages_by_class, config.page_size, prefix_caching,
                             prefix_block=math.lcm(flush_block, config.page_size) if flush_block else 0)
        self.chains = ChainStore(self.pool, layout.layers, self.method, fingerprint=self.default_lane.fingerprint,
                                 rows=self.rows, copy_row=self.attention.copy_rows)
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
            chains=self.chains,
            rows=self.rows,
            rules=self.default_lane.rules,
        )
        self.grammars = GrammarBook(self.tokenizer, self.spec.vocab_size, self.spec.eos_token_ids)
        self.runner = ModelRunner(self.model, [], self.device, seed=config.seed, grammars=self.grammars,
                                  fused_sampling=backend == "triton")
        for lane in self.lanes:
            self._join_group(lane)
        self.sequences: dict[int, Sequence] = {}
        self.chains.settle = partial(_settle, self.default_lane)
        self.pruner = self._pruner(self.default_lane)
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

    # ---- lanes (runtime/lanes.py) ----------------------------------------------------------
    def _bind(self, method: KVMethod) -> None:
        """Binds `method` to the model: its budget, its input tensors (from the model's directory, or
        the directory the config names for them)."""
        # the contract's `evict_interval`: before anything sizes memory by the method's budget
        method.evict_interval = self.config.evict_interval
        inputs_dir = Path(self.config.method_inputs) if self.config.method_inputs is not None else self.loaded.path
        method.bind(self.spec.num_layers, self.spec.num_kv_heads, model_dir=inputs_dir,
                    max_context=self.max_model_len, num_heads=self.spec.num_heads,
                    **({} if self.tp is None else {"heads": self.heads}))

    def _prefill_forms(self) -> dict[str, str]:
        """PagedAttention's prefill forms, `auto` resolved as measured on an H200 (docs/benchmarks.md, the section on
        prefill attention through cuDNN and MLA's two prefill forms): `prefill_attention` is `sdpa` on
        CUDA (0.97-1.01x cuDNN, 1.3-1.5x the paged kernel), the paged op elsewhere; `mla_prefill` is decompressed
        (12.7-15.8x the absorbed kernel) unless asked absorbed."""
        form = self.config.prefill_attention
        if form == "auto":
            form = "sdpa" if self.device.type == "cuda" else "kernel"
        return {"prefill_attention": form,
                "mla_prefill": "absorbed" if self.config.mla_prefill == "absorbed" else "decompressed"}

    def _cut(self, model) -> None:
        """Cuts `model` to this rank's part (runtime/distributed/shard.py)."""
        self.shards = shard_model(model, self.tp, self.config.expert_parallel)

    @cached_property
    def heads(self) -> HeadCollective | None:
        """What the method's hooks need of the other ranks (None: one rank)."""
        return None if self.tp is None else HeadCollective(self.tp, self.shards)

    def _lane(self, method: KVMethod, params: dict, storage: StorageClasses, classes: tuple[int, ...],
              loaded: bool = True) -> Lane:
        """A lane of `method` (its layers' specs `storage`) over the pool classes `classes` (its attention over
        the pool's stores)."""
        attention = PagedAttention(self.stores, self.backend, self.layout.layers, classes, **self._prefill_forms())
        salt = storage_salt(self.model_ref, self.spec, self.pool_classes, classes)
        rules = lane_rules(method, attention, self.config.enable_prefix_caching, salt, self.config.decode_rings)
        lane = Lane(method.name, params, method, storage, classes, rules,
                    method_fingerprint(self.model_ref, self.spec, method), loaded)
        lane.attention = attention
        return lane

    def _join_group(self, lane: Lane) -> None:
        """Puts `lane` in the attention group of its storage and kernels (runtime/spec_group.py), or one of
        its own; its hooks, text spans and replay pass."""
        stores = self.stores
        for group in self.runner.groups:
            if (shares_attention(lane) and all(shares_attention(other) for other in group.lanes)
                    and group.attention.layer_class == lane.layer_class
                    and variants_of(lane, stores) == variants_of(group.lanes[0], stores)):
                group.lanes.append(lane)
                lane.group = group
                lane.hooks = StepHooks(lane.method, stores, group.executors, group.tables, self.pool,
                                       group.num_layers, copy_rows=group.attention.copy_rows,
                                       layer_class=group.attention.layer_class)
                break
        else:
            self.runner.groups.append(SpecGroup([lane], self.model, lane.attention, self.config.page_size,
                                                self.max_model_len, self.config.max_num_seqs, self.device,
                                                self.config.cuda_graphs, self.pool))
            self.runner.groups[-1].chain_window = self.runner.groups[0].chain_window
        method = lane.method
        if method.text_partitions:  # spans of the stored tokens' text (runtime/text_spans.py)
            if self.tokenizer is None:
                raise ConfigError(f"method {method.name!r} reads the spans of its tokens' text: the model needs "
                                  "a tokenizer", param="method")
            lane.hooks.text_spans = {name: TextSpans(self.tokenizer, markers)
                                     for name, markers in method.text_partitions.items()}
        lane.hooks.rings = lane.rules.rings  # its step end leaves ringed rows alone (runtime/kv/ring.py)
        if method.replay is not None:  # re-reads each prompt after its prefill (runtime/context_replay.py)
            lane.replay = ContextReplay(lane.group, method.replay, self.tokenizer)
            method.budget.replay_tokens = lane.replay.longest

    def lane_of(self, seq: Sequence) -> Lane:
        return seq.lane or self.default_lane

    def lane_for(self, name: str | None, params: dict | None = None) -> Lane:
        """The lane a request asks for (`name` None: the default method; `params`: its parameters over the
        loaded ones'), made on first use where the parameters differ (runtime/lanes.py). ConfigError for
        a method the engine did not load, parameters it does not have or out of range, or parameters
        that change how the method stores K/V."""
        name, params = requested(name, params, self.method.name)
        base = next((lane for lane in self.lanes if lane.loaded and lane.name == name), None)
        if base is None:
            raise ConfigError(f"method {name!r} is not served here; this server runs "
                              f"{', '.join(lane.name for lane in self.lanes if lane.loaded)}", param="method")
        if not params:
            return base
        params = {**base.method.params, **params} if hasattr(base.method, "params") else params
        for lane in self.lanes:
            if lane.name == name and getattr(lane.method, "params", None) == params:
                return lane
        given = {k: v for k, v in params.items() if getattr(base.method, "params", {}).get(k) != v}
        if sum(not lane.loaded for lane in self.lanes) >= MAX_REQUEST_LANES:
            raise ConfigError(f"this server already runs {MAX_REQUEST_LANES} parameter variants of its methods; "
                              "use the loaded parameters", param="method_params")
        method = resolve_method(self._sources[name], params)
        self._bind(method)
        storage = self.layout.storage(self.spec, method, self.config.page_size)
        classes = self.pool_classes.classes_of(storage, getattr(method, "layer_digest", ""), add=False)
        if (classes is None or CacheLayout.of(self.spec, method) != self.layout or method.replay is not None
                or method.page_tokens() not in (None, self.config.page_size)):
            raise ConfigError(f"method {name!r} with parameters {given} stores K/V otherwise than the loaded "
                              f"{name!r}; serve it with those parameters (--method-params)", param="method_params")
        lane = self._lane(method, given, storage, classes, loaded=False)
        self.lanes.append(lane)
        self._join_group(lane)
        return lane

    def lane_stats(self) -> list[dict]:
        """Per lane (its `key`): requests added, their prompt tokens, tokens generated by finished ones,
        sequences running and the KV pages they hold (/metrics)."""
        running = {id(lane): [0, 0] for lane in self.lanes}
        for seq in self.scheduler.running:
            held = running[id(self.lane_of(seq))]
            held[0] += 1
            held[1] += sum(len(t) for t in seq.page_tables)
        return [{"method": lane.key, **lane.counts, "running": running[id(lane)][0], "kv_pages": running[id(lane)][1]}
                for lane in self.lanes]

    def method_cards(self) -> list[dict]:
        """The methods loaded at start, the default first: each one's name and parameters (values and
        declared types), as GET /v1/models lists them."""
        out = []
        for lane in self.lanes:
            if not lane.loaded:
                continue
            code = getattr(lane.method, "code", None)
            declared = {} if code is None else code.manifest.get("parameters", {})
            values = getattr(lane.method, "params", {})
            out.append({"name": lane.name, "default": lane is self.default_lane,
                        "parameters": {k: {"value": values.get(k, d.get("default")), "type": str(d.get("type", ""))}
                                       for k, d in declared.items()}})
        return out

    def _pruner(self, lane: Lane) -> Pruner:
        group = lane.group
        return Pruner(self.chains, group.executors, self.layout.layers, group.attention.layer_class,
                      group.attention.page_starts, self.heads)

    def _kv_budget_bytes(self) -> int:
        """Bytes for KV pages: the config's, else a share of free device memory (the least of the ranks',
        under tensor parallelism: every rank must hold as many pages)."""
        budget = self._own_kv_budget()
        if self.tp is not None:
            budget = self.tp.least(budget)
        return budget

    def _own_kv_budget(self) -> int:
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
        of the same prompt instead of running the model (runtime/prefill_record.py). The request
        runs the method `params.method` names (with `params.method_params`), else the default one.
        Tensor parallelism: the followers add it with the ids it got here."""
        if self.tp is not None and (record is not None or replay is not None):
            raise ConfigError("prefill records are not shared across tensor-parallel ranks yet", param="replay")
        seq = self.add_request_as(prompt_token_ids, params, chain, record, replay)
        self._mirror("add_request_as", prompt_token_ids, params, chain, ids=(seq.seq_id, seq.chain_id))
        return seq

    def add_request_as(self, prompt_token_ids: list[int], params: SamplingParams,
                       chain: ChainSpec | None = None, record: PrefillRecord | None = None,
                       replay: PrefillRecord | None = None, ids: tuple[int, str | None] | None = None) -> Sequence:
        """`add_request`, with the sequence and chain ids the leader rank gave it (`ids`; None: new ones)."""
        lane = self.lane_for(params.method, params.method_params)
        method = lane.method
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
        if (record is not None or replay is not None) and not self.shares_prefills_in(lane):
            why = ("cuts its cache after every prefill chunk" if method.chunk_keeps else
                   "stores K/V in a format its prefill attention reads back")
            raise ConfigError(f"method {method.name!r} {why}, so its forward is its own: it neither records nor "
                              "replays prefills", param="replay")
        if method.replay is not None and chain is not None and not chain.open:
            raise ConfigError(f"method {method.name!r} re-reads the whole stored prompt after its prefill; a "
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
            seq_id=None if ids is None else ids[0],
        )
        if record is not None:
            record.start(prompt_token_ids, self.layout.layers)
        seq.record, seq.replay = record, replay
        seq.lane, seq.rules = lane, lane.rules
        if chain is None:
            self._check_fits(seq, params)
            self.scheduler.add(seq)
        else:
            self.chains.next_id = None if ids is None else ids[1]
            try:
                record = self.chains.begin(chain, prompt_token_ids, lane)
            finally:
                self.chains.next_id = None
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
        lane.counts["requests"] += 1
        lane.counts["prompt_tokens"] += n
        return seq

    def _check_fits(self, seq: Sequence, params: SamplingParams) -> None:
        """OutOfKVMemory when the request can never fit the pool; ChainCapacity when a chained one
        cannot fit beside the pages active chains pin (idle ones would be evicted)."""
        physical = seq.physical_prompt_len  # a continuation counts its stored history, not its logical one
        grown = physical + min(params.max_tokens, self.max_model_len - len(seq.token_ids))
        rules = self.lane_of(seq).rules
        needed = self.scheduler.pages_needed_by_class(physical, grown, rules)
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
            compacts = rules.compacts_prefill or rules.compacts_decode
            copies = (self.pool.count_by_class(seq.chain.pages()) if compacts
                      else self.scheduler.by_class([1] * self.layout.layers, rules))
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
        clones = self.clone_sequence_as(seq.seq_id, count)
        self._mirror("clone_sequence_as", seq.seq_id, count, ids=[c.seq_id for c in clones])
        return clones

    def clone_sequence_as(self, seq_id: int, count: int, ids: list[int] | None = None) -> list[Sequence]:
        """`clone_sequence` of sequence `seq_id`, the clones with the leader rank's ids (`ids`; None: new ones)."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ConfigError(f"clone count must be a non-negative integer, got {count!r}", param="count")
        self.drain()
        seq = self.sequences[seq_id]
        clones = [
            Sequence(seq.token_ids[: seq.num_prompt_tokens], params=seq.params, eos_token_ids=seq.eos_token_ids,
                     max_model_len=seq.max_model_len, num_layers=self.layout.layers,
                     seq_id=None if ids is None else ids[i])
            for i in range(count)
        ]
        pairs = self.scheduler.clone(seq, clones)
        method = self.lane_of(seq).method
        self.attention.copy_pages([src for src, _ in pairs], [dst for _, dst in pairs])
        if seq.row is not None:
            self.attention.copy_rows([seq.row] * len(clones), [clone.row for clone in clones])
        source_generator = self.runner.generators.get(seq.seq_id)
        for clone in clones:
            if Hook.CLONE in method.hooks:
                method.clone(seq.seq_id, clone.seq_id)
            self.runner.add_request(clone.seq_id, None if source_generator is None else 0)
            if source_generator is not None:  # the clone draws what the source would
                self.runner.generators[clone.seq_id].set_state(source_generator.get_state())
            self.grammars.copy(seq.seq_id, clone.seq_id)
            clone.logprobs = None if seq.logprobs is None else list(seq.logprobs)
            clone.prompt_logprobs = None if seq.prompt_logprobs is None else list(seq.prompt_logprobs)
            self.sequences[clone.seq_id] = clone
        return clones

    def set_chain_limits(self, limits: ChainLimits) -> None:
        """Bounds on idle chains (ChainStore.expire). Under tensor parallelism every rank applies the count cap
        itself (a logical clock), and the TTL only in `expire_chains`, by the leader's clock."""
        self.chains.limits = limits
        self.chains.ttl_by_sweep = self.tp is not None
        self._mirror("set_chain_limits", limits)

    def expire_chains(self, now: float | None = None) -> int:
        """Drops the idle chains the limits no longer allow at unix time `now` (None: the clock's), between
        steps (the server's sweep); the other ranks drop the same ones. How many."""
        dropped = self.chains.expire(now, sweep=True)
        if dropped:
            self._mirror("forget_chains", dropped)
        return len(dropped)

    def forget_chains(self, chain_ids: list[str]) -> None:
        """A follower rank drops the chains the leader's `expire_chains` dropped."""
        self.chains.forget(chain_ids)

    def drop_chain(self, chain_id: str, owner: str | None) -> None:
        """Forgets a chain and frees its pages (ChainNotFound / ChainEvicted / ChainBusy)."""
        self.chains.drop(chain_id, owner)
        self._mirror("drop_chain", chain_id, owner)

    def prune_chain(self, chain_id: str, owner: str | None, request: PruneRequest) -> dict:
        """Prunes an idle chain's history (runtime/chain_prune.py); its report as a dict. Raises the
        chain errors, InvalidPrune for a request that names nothing prunable."""
        self._mirror("prune_chain", chain_id, owner, request)  # before: the ranks' prunes meet in all-reduces
        record = self.chains.get(chain_id, owner)
        lane = record.lane or self.default_lane
        pruner = self.pruner if lane is self.default_lane else self._pruner(lane)
        pruner.check_prunable()
        with ranks_scope(self.heads):  # a scorer's folds over query groups combine the ranks' (TP)
            report = pruner.prune(record, request, self._scorer(request, lane))
        return {"id": chain_id, **report.as_dict()}

    def _scorer(self, request: PruneRequest, lane: Lane | None = None) -> Scorer:
        """The scorer a prune names, else the default one or that of the chain's method (`lane`'s)."""
        lane = lane or self.default_lane
        key = json.dumps([request.scorer, request.scorer_params, lane.key], sort_keys=True, default=repr)
        scorer = self._scorers.get(key)
        if scorer is None:
            scorer = self._scorers[key] = resolve_scorer(request, lane.method, self.config.prune_scorer)
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
        lane = record.lane or self.default_lane
        try:
            pruner = self.pruner if lane is self.default_lane else self._pruner(lane)
            pruner.prune(record, self.auto_prune, self._scorer(self.auto_prune, lane))
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
        self._mirror("abort", seq_id)

    def capture_graphs(self) -> None:
        """Captures every attention group's decode graphs at their first context bucket (a server does it
        at start rather than in its first requests' latency); every rank does (the captures' warm-up steps
        run the model)."""
        self._mirror("capture_graphs")
        for group in self.runner.groups:
            if group.graphs is not None:
                log.info("capturing CUDA graphs for decode batches %s", group.graphs.buckets)
                with ranks_scope(self.heads):
                    group.graphs.capture_all()

    # ---- tensor parallelism (runtime/distributed/) ---------------------------------------------
    def _mirror(self, name: str, *args, **kwargs) -> None:
        """The leader rank sends a command to its followers, which replay it (runtime/distributed/workers.py)."""
        if self.tp is not None and self.tp.leads:
            self.tp.broadcast((name, args, kwargs))

    def close(self) -> None:
        """Stops the follower ranks (tensor parallelism; nothing to do on one rank). The engine is unusable after."""
        if self.tp is None or not self.tp.leads:
            return
        self.tp.broadcast(None)
        for proc in self._followers:
            proc.join(timeout=60)
        self.tp.close()
        self.tp = None

    @property
    def shares_prefills(self) -> bool:
        """Whether this engine's prefill forward is every method's (runtime/prefill_record.py), so it
        may record prefills and replay others': not when its method cuts the cache while prefilling,
        nor when K/V are stored in a format attention reads back (quantized: earlier chunks, and
        without a residual window the chunk itself, are read as stored)."""
        return self.shares_prefills_in(self.default_lane)

    @staticmethod
    def shares_prefills_in(lane: Lane) -> bool:
        """`shares_prefills` for one lane's method."""
        return not lane.method.chunk_keeps and all(s.spec.dense for s in lane.attention.used)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._launched is not None or bool(self._drained)

    def step(self) -> list[Sequence]:
        """One engine step; returns the sequences that finished in it.

        Async scheduling: a step is left running on the device (`_launched`); the next call
        schedules and launches the step after it over its pending tokens (decoding rows) and the
        host's (prefill chunks, admissions), and only then waits for its tokens and commits them.
        The host's work for a step so overlaps the device's previous one. A step that cannot be
        scheduled ahead (a chain, structured outputs, pages short of every row's next step) is run
        the plain way, after a commit (`Scheduler.schedule_ahead`)."""
        self._mirror("step")
        with ranks_scope(self.heads):  # the lowering's reductions over query heads combine the ranks' (TP)
            return self._step()

    def _step(self) -> list[Sequence]:
        finished, self._drained = self._drained, []
        launched, self._launched = self._launched, None
        if launched is not None:
            batch, out = launched
            with host_range("kvc.schedule"):
                ahead = self.scheduler.schedule_ahead(batch)
            if ahead is not None:
                ahead_out = self.runner.run(ahead, ahead.needs_sample(), out, defer=True)
                finished += self._commit(batch, out)
                with host_range("kvc.advance"):
                    self.scheduler.advance(ahead, ahead_out.compacted, ahead_out.rewritten)
                self._launched = (ahead, ahead_out)
                return finished
            finished += self._commit(batch, out)  # then this call's step, scheduled the plain way
        with host_range("kvc.schedule"):
            batch = self.scheduler.schedule()
        if batch is None:
            return finished
        overlap = self._async and self.scheduler.may_run_ahead(batch)
        out = self.runner.run(batch, batch.needs_sample(), defer=overlap)
        with host_range("kvc.advance"):
            self.scheduler.advance(batch, out.compacted, out.rewritten)
        if overlap:
            self._launched = (batch, out)
            return finished
        return finished + self._commit(batch, out)

    def _commit(self, batch, out) -> list[Sequence]:
        """Appends an advanced step's tokens and logprobs (waiting for them); the sequences that
        finished."""
        with host_range("kvc.commit"):
            return self._commit_tokens(batch, out)

    def _commit_tokens(self, batch, out) -> list[Sequence]:
        sampled = out.resolve()
        if self.tp is not None:  # every rank appends the leader's tokens, of the step the leader scheduled
            step = ([(seq.seq_id, n) for seq, n in zip(batch.seqs, batch.num_new_tokens)], self.pool.num_free)
            sampled, scheduled = self.tp.broadcast((sampled, step) if self.tp.leads else None)
            if scheduled != step:
                raise RuntimeError(f"tensor-parallel rank {self.tp.rank} scheduled {step[0]} with {step[1]} free "
                                   f"pages, rank 0 {scheduled[0]} with {scheduled[1]}: the ranks' engines diverged")
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
        self._mirror("drain")
        launched, self._launched = self._launched, None
        if launched is not None:
            with ranks_scope(self.heads):  # (an automatic prune at a turn's end combines the ranks')
                self._drained += self._commit(*launched)

    def _release(self, seq_id: int) -> None:
        seq = self.sequences.pop(seq_id, None)
        self.runner.remove_request(seq_id)
        self.grammars.remove(seq_id)
        lane = self.default_lane if seq is None else self.lane_of(seq)
        if seq is not None:
            lane.counts["generated_tokens"] += seq.num_generated
        if Hook.RELEASE in lane.method.hooks:
            lane.method.release(seq_id)


def _check_storage(method: KVMethod, storage: StorageClasses) -> None:
    """What the engine cannot serve of a method's KV specs: keys stored before RoPE that a plan moves,
    one low-rank operand without the other."""
    specs = storage.specs
    if any(s.prerope for s in specs) and (method.compacts or method.rewrites or any(s.head_starts for s in specs)):
        raise ConfigError(f"method {method.name!r} stores keys before RoPE, each read at its slot's position; "
                          "it cannot also move or drop stored tokens (keeps, rewrites)", param="method")
    if any(s.low_rank and not all(isinstance(e, LowRank) for e in (s.keys, s.values)) for s in specs):
        raise ConfigError(f"method {method.name!r}: a low-rank operand needs the other one low-rank too (the "
                          "lowrank kernels read both)", param="method")


def _settle(default: Lane, seq: Sequence) -> None:
    """A chain's turn ends: its sequence's layers back in time order, by its lane's hooks (ChainStore.settle)."""
    (seq.lane or default).hooks.settle(seq)
