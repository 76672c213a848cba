"""Runs `kvc eval`'s cases through kvc's engine (runtime/eval/, docs/accuracy.md).

A setting is one method at one KV budget: every method that declares a `budget` parameter (tokens
kept per KV head after prefill) runs at each `--budgets` value, a method without one (`full`) once
at its defaults. Each setting runs in its own engine, all over one loaded model
(`Engine(loaded=...)`: the weights load once, each engine has its own KV pool and method).

One prefill per case, shared by every setting (runtime/prefill_record.py): a method's prefill
hooks never change the forward, so the first setting's engine prefills a group of cases once,
recording each layer's q/k/v and the last token's logits (and answers them: its own result), and
the engine of every other setting takes those prefills as records: it stores their K/V, runs its
method's prefill hooks and compaction on them, and decodes from there. Engines schedule prefills
first so that the replaying engines batch exactly as the recording one did. `--no-share-prefill`
runs the model in every engine instead (the same answers, about as many prefills as settings).
A method whose forward is its own (`Engine.shares_prefills`: DuoAttention's streaming heads are cut
after every chunk; quantized K/V are read back as stored) neither records nor replays: it prefills
itself.
Cases go in groups whose records fit `record_memory`; a group runs as one batch, greedy. A
multi-turn task opens a chain per case and asks each later turn through it, so a turn prefills only
its new suffix over the method's compressed history. `--reference kvpress` runs the same
single-turn cases through kvpress_reference.py. Each cell (setting x task x length) goes to
`on_cell` when it is done (report.py writes it to disk), and cells already in a previous result of
the same run are skipped: an interrupted run keeps what it finished and a rerun continues it.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvc.runtime.chains import ChainSpec
from kvc.runtime.config import EngineConfig
from kvc.runtime.engine import Engine
from kvc.runtime.errors import ConfigError
from kvc.runtime.eval.stats import wilson_interval
from kvc.runtime.eval.tasks import TASKS, Case, Task, make_cases
from kvc.runtime.llm import LLM, RequestOutput
from kvc.runtime.methods import resolve_method
from kvc.runtime.models.loader import LoadedModel, resolve_model
from kvc.runtime.prefill_record import PrefillRecord
from kvc.runtime.sampling_params import SamplingParams

log = logging.getLogger(__name__)

BUDGET_PARAM = "budget"  # the .kvm parameter `--budgets` sets (docs/language.md, "Budgets")
KVC, KVPRESS = "kvc", "kvpress"


@dataclass(frozen=True)
class Setting:
    """One method at one budget (None: a method without a budget, run at its defaults)."""

    method: str
    budget: int | None
    params: tuple[tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        return self.method if self.budget is None else f"{self.method}@{self.budget}"

    @property
    def method_params(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.params}


def _hashable(params: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """Setting.params: list values (a layer list) as tuples, so that a setting can key a dict."""
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in params.items()))


@dataclass
class EvalConfig:
    model: str | None = None  # None: the embedded default model
    methods: list[str] = field(default_factory=lambda: ["full"])
    budgets: list[int] = field(default_factory=lambda: [128, 256, 512, 1024])
    tasks: list[str] = field(default_factory=lambda: ["passkey"])
    lengths: list[int] = field(default_factory=lambda: [2048])
    cases: int = 24
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    batch: int = 16  # requests running together in one engine (a group of cases)
    method_params: dict[str, Any] = field(default_factory=dict)  # extra parameters for every method
    reference: str | None = None  # "kvpress": the same cases through kvpress's presses
    share_prefill: bool = True  # one prefill per case, replayed into every setting's engine
    record_memory: int = 6 * 2**30  # bytes of prefill records held at once (sets the group size)
    evict_interval: int = 1  # EngineConfig.evict_interval: decode-time eviction every N tokens of growth
    method_inputs: str | None = None  # EngineConfig.method_inputs: where the methods' input files are

    def __post_init__(self) -> None:
        unknown = [t for t in self.tasks if t not in TASKS]
        if unknown:
            raise ConfigError(f"unknown task(s) {', '.join(unknown)}; known: {', '.join(sorted(TASKS))}",
                              param="tasks")
        for name, values in (("budgets", self.budgets), ("lengths", self.lengths)):
            if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
                raise ConfigError(f"--{name} takes positive integers, got {values!r}", param=name)
        for name in ("cases", "batch", "evict_interval"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"--{name} must be a positive integer, got {value!r}", param=name)
        if not self.methods:
            raise ConfigError("--methods names at least one method", param="methods")
        if self.reference not in (None, KVPRESS):
            raise ConfigError(f"--reference takes kvpress, got {self.reference!r}", param="reference")


def settings_for(cfg: EvalConfig) -> list[Setting]:
    """Every (method, budget) the run covers, in `--methods` order; unknown methods and bad
    parameters fail here, before any model work."""
    out: list[Setting] = []
    used: set[str] = set()
    for method in cfg.methods:
        # `method_params` go to the methods that declare them (`--method-param ratio=0.25`: kvzip's, not full's)
        declared = resolve_method(method, None).params
        own = {k: v for k, v in cfg.method_params.items() if k in declared}
        used |= set(own)
        if own:
            resolve_method(method, own)  # the method's own range check, now
        if BUDGET_PARAM in declared:
            for budget in cfg.budgets:
                params = {**own, BUDGET_PARAM: budget}
                resolve_method(method, params)  # the method's own range check, now
                out.append(Setting(method, budget, _hashable(params)))
        else:
            out.append(Setting(method, None, _hashable(own)))
    unused = sorted(set(cfg.method_params) - used)
    if unused:
        raise ConfigError(f"method parameter(s) {', '.join(unused)} belong to none of the methods "
                          f"{', '.join(cfg.methods)}", param="method_params")
    return out


def cell_key(engine: str, setting: Setting, task: str, length: int) -> tuple:
    return (engine, setting.method, setting.budget, task, length)


class Evaluation:
    """One `kvc eval` run: the cases, the settings, and the cells done so far."""

    def __init__(self, cfg: EvalConfig, done: dict[tuple, dict] | None = None,
                 loaded: LoadedModel | None = None) -> None:
        self.cfg = cfg
        self.settings = settings_for(cfg)
        probe = EngineConfig(model=cfg.model, device=cfg.device, dtype=cfg.dtype)
        self.device = probe.resolve_device()
        dtype = None if cfg.dtype == "auto" else probe.resolve_dtype(self.device, None)
        self.loaded = loaded or resolve_model(cfg.model, self.device, dtype)
        if self.loaded.path is None:
            raise ConfigError("kvc eval needs a model with a tokenizer (a directory, gguf:FILE or the default), "
                              "not a random:NAME shape", param="model")
        self.tokenizer = self.loaded.tokenizer  # the one every engine over this model uses
        self.tasks: dict[str, Task] = {name: TASKS[name] for name in cfg.tasks}
        self.cases: dict[tuple[str, int], list[Case]] = {
            (task, length): make_cases(task, self.tokenizer, length, cfg.cases, cfg.seed)
            for task in cfg.tasks for length in cfg.lengths
        }
        self.done = dict(done or {})
        self._longest = max(_tokens_needed(c) for cases in self.cases.values() for c in cases)  # sizes every engine
        self._reference = None  # kvpress's Hugging Face model, loaded at its first cell

    # ---- the plan ---------------------------------------------------------------------------
    def cells(self) -> list[tuple[str, Setting, str, int]]:
        """(engine, setting, task, length) of every cell, kvc's first, then the reference's."""
        out = [(KVC, s, t, n) for s in self.settings for t in self.cfg.tasks for n in self.cfg.lengths]
        if self.cfg.reference == KVPRESS:
            from kvc.runtime.eval.kvpress_reference import kvpress_methods

            supported = set(kvpress_methods())
            out += [(KVPRESS, s, t, n) for s in self.settings for t in self.cfg.tasks for n in self.cfg.lengths
                    if s.method in supported and not self.tasks[t].multi_turn]
        return out

    def items(self, task: str, length: int) -> int:
        """Questions in a cell: every case's turns."""
        return sum(1 + len(c.turns) for c in self.cases[task, length])

    def pending(self) -> list[tuple[str, Setting, str, int]]:
        return [c for c in self.cells() if cell_key(c[0], c[1], c[2], c[3]) not in self.done]

    # ---- running ----------------------------------------------------------------------------
    def run(self, on_cell: Callable[[dict], None] | None = None,
            on_items: Callable[[int], None] | None = None) -> list[dict]:
        """Every pending cell; each finished cell goes to `on_cell` at once."""
        pending = self.pending()
        kvc_cells: dict[tuple[str, int], list[Setting]] = {}
        for engine, setting, task, length in pending:
            if engine == KVC:
                kvc_cells.setdefault((task, length), []).append(setting)
        for (task, length), settings in kvc_cells.items():
            self._run_kvc(settings, task, length, on_cell, on_items)
        reference = [c for c in pending if c[0] == KVPRESS]
        for task, length in dict.fromkeys((t, n) for _, _, t, n in reference):
            settings = [s for _, s, t, n in reference if (t, n) == (task, length)]
            for cell in self._run_kvpress(settings, task, length, on_items):
                self._finish(cell, on_cell)
        return list(self.done.values())

    def _finish(self, cell: dict, on_cell: Callable[[dict], None] | None) -> None:
        key = (cell["engine"], cell["method"], cell["budget"], cell["task"], cell["length"])
        self.done[key] = cell
        if on_cell is not None:
            on_cell(cell)

    def groups(self, task: str, length: int) -> list[list[Case]]:
        """The cases of a cell in groups of at most `batch`, whose prefill records fit `record_memory`."""
        cases = self.cases[task, length]
        spec = self.loaded.spec
        per_case = (spec.num_layers * max(len(c.prompt) for c in cases) * (spec.num_heads + 2 * spec.num_kv_heads)
                    * spec.head_dim * spec.dtype.itemsize)
        size = self.cfg.batch if not self.cfg.share_prefill else max(1, min(self.cfg.batch,
                                                                             self.cfg.record_memory // per_case))
        return [cases[i:i + size] for i in range(0, len(cases), size)]

    def _run_kvc(self, settings: list[Setting], task: str, length: int, on_cell: Callable[[dict], None] | None,
                 on_items: Callable[[int], None] | None) -> None:
        """Every pending setting of one (task, length): per group of cases, the first setting's
        engine prefills and records them, every other setting's engine replays the records."""
        multi_turn = self.tasks[task].multi_turn
        outputs: dict[Setting, list[list[RequestOutput]]] = {s: [] for s in settings}
        seconds = dict.fromkeys(settings, 0.0)
        groups = self.groups(task, length)
        for g, group in enumerate(groups):
            records = [PrefillRecord() for _ in group] if self.cfg.share_prefill else None
            recorded = False
            for setting in settings:
                start = time.perf_counter()
                llm = self._llm(setting)
                try:  # the first setting's engine records the prefills (any method's forward is the same)
                    if records is None or not llm.engine.shares_prefills:  # its own forward (Engine.shares_prefills)
                        shared = {}
                    else:
                        shared = {"replay": records} if recorded else {"record": records}
                        recorded = True
                    outputs[setting].extend(_run_group(llm, group, multi_turn, on_items, **shared))
                finally:
                    del llm
                    gc.collect()
                seconds[setting] += time.perf_counter() - start
                if g == len(groups) - 1:
                    texts = [[o.text for o in turns] for turns in outputs[setting]]
                    cached = [[o.num_cached_tokens for o in turns] for turns in outputs[setting]]
                    self._finish(self._cell(KVC, setting, task, length, texts, seconds[setting], cached), on_cell)

    def _llm(self, setting: Setting) -> LLM:
        cfg = self.cfg
        spec = self.loaded.spec
        longest = self._longest
        bytes_per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * spec.dtype.itemsize
        config = EngineConfig(
            model=cfg.model, method=setting.method, method_params=setting.method_params or None, device=cfg.device,
            dtype=cfg.dtype, max_num_seqs=cfg.batch, max_model_len=min(spec.max_position_embeddings, longest + 16),
            kv_cache_memory=int(cfg.batch * (longest + 64) * bytes_per_token * 1.25), seed=cfg.seed,
            evict_interval=cfg.evict_interval, method_inputs=cfg.method_inputs,
            prefill_first=True, enable_prefix_caching=False,  # replays batch as the recording did
        )
        return LLM.from_engine(Engine(config, loaded=self.loaded))

    def _run_kvpress(self, settings: list[Setting], task: str, length: int,
                     on_items: Callable[[int], None] | None) -> list[dict]:
        """One cell of every setting at once: kvpress_reference shares each prompt's prefill among
        the settings' presses. `seconds` is the cell's share of that run."""
        from kvc.runtime.eval.kvpress_reference import (ReferencePrompt, load_reference_model, reference_methods,
                                                        run_on_model)

        if self._reference is None:
            self._reference = load_reference_model(self.loaded.path, str(self.device), self.loaded.spec.dtype)
        model, eos = self._reference
        cases = self.cases[task, length]
        prompts = [ReferencePrompt(c.prompt, c.max_tokens, c.stop_token_ids) for c in cases]
        start = time.perf_counter()
        methods = reference_methods([(s.method, s.method_params) for s in settings], model.config)
        progress = None if on_items is None else (lambda done, total: on_items(len(settings)))
        answers = run_on_model(model, prompts, methods, eos, progress)
        seconds = (time.perf_counter() - start) / max(1, len(settings))
        return [self._cell(KVPRESS, s, task, length,
                           [[self.tokenizer.decode(ids, skip_special_tokens=True)] for ids in answers[i]], seconds)
                for i, s in enumerate(settings)]

    def _cell(self, engine: str, setting: Setting, task: str, length: int, texts: list[list[str]],
              seconds: float, cached: list[list[int]] | None = None) -> dict:
        """A cell's result: per question the expected answer, the output and the verdict (and for kvc
        the prompt tokens the engine did not prefill: a chained turn's reused history)."""
        judge = self.tasks[task]
        items = []
        for i, (case, turns) in enumerate(zip(self.cases[task, length], texts)):
            expected = [case.answer] + [t.answer for t in case.turns]
            for turn, (want, got) in enumerate(zip(expected, turns)):
                item = {"case": case.index, "turn": turn, "expected": want, "output": got,
                        "correct": bool(judge.correct(want, got)), **dict(case.info)}
                if cached is not None:
                    item["cached_tokens"] = cached[i][turn]
                items.append(item)
        correct = sum(i["correct"] for i in items)
        low, high = wilson_interval(correct, len(items))
        return {"engine": engine, "method": setting.method, "budget": setting.budget,
                "params": setting.method_params, "task": task, "length": length, "n": len(items),
                "correct": correct, "accuracy": correct / len(items) if items else 0.0, "ci95": [low, high],
                "seconds": round(seconds, 2), "items": items}


def _params(case: Case) -> SamplingParams:
    return SamplingParams(max_tokens=case.max_tokens, temperature=0.0, stop_token_ids=list(case.stop_token_ids))


def _tokens_needed(case: Case) -> int:
    """The longest history a case reaches: its prompt, every turn's suffix and every answer."""
    return len(case.prompt) + sum(len(t.suffix) for t in case.turns) + (1 + len(case.turns)) * case.max_tokens


def _run_group(llm: LLM, cases: list[Case], multi_turn: bool, on_items: Callable[[int], None] | None,
               record: list[PrefillRecord] | None = None,
               replay: list[PrefillRecord] | None = None) -> list[list[RequestOutput]]:
    """Each case's outputs, turn by turn. A multi-turn case runs through one chain: turn k's prompt
    is everything so far (prompt, the tokens generated, the earlier suffixes) plus its own suffix,
    and only that suffix is prefilled; the first turn records or replays its prefill."""
    params = [_params(c) for c in cases]
    chains = [ChainSpec(open=True) for _ in cases] if multi_turn else None
    outs = llm.generate([list(c.prompt) for c in cases], params, chain=chains, on_finished=on_items,
                        record=record, replay=replay)
    results = [[o] for o in outs]
    if not multi_turn:
        return results
    histories = [list(c.prompt) + o.token_ids for c, o in zip(cases, outs)]
    ids = [o.chain_id for o in outs]
    try:
        for turn in range(max(len(c.turns) for c in cases)):
            live = [i for i, c in enumerate(cases) if turn < len(c.turns)]
            prompts = [histories[i] + list(cases[i].turns[turn].suffix) for i in live]
            turn_outs = llm.generate(prompts, [params[i] for i in live],
                                     chain=[ChainSpec(continue_id=ids[i]) for i in live], on_finished=on_items)
            for i, prompt, out in zip(live, prompts, turn_outs):
                histories[i] = prompt + out.token_ids
                results[i].append(out)
    finally:
        for chain_id in ids:
            if chain_id is not None:
                llm.engine.drop_chain(chain_id, None)
    return results
