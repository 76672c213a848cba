"""Compiled methods as `KVMethod`s: one generic adapter over a folder of generated code.

Nothing here knows a method by name. `resolve_compiled` finds the folder through the compile cache
(`kvc.compiler.cache.locate`): kernels_generated/<method>/ when fresh, else methods/<method>.kvm
(or a user's .kvm path) compiled into $KVC_CACHE_DIR/methods/; the generated modules are loaded
by file path. The adapter reads `manifest.json` (lowered? parameters, kernels and their query
windows) and calls the generated torch lowering at the contract's points:

- `prefill_chunk`: keeps, per (sequence, layer), the last `w` post-RoPE queries of the prompt, where
  `w` is the largest query window of the method's prefill_end kernels (the manifest's WINDOW_EXPR;
  all queries when a kernel has none, none when no kernel reads queries). A generated
  `prefill_chunk` hook (H2O's column sums) is called per chunk with the chunk's causal attention
  over the keys stored so far, and its state is kept per (sequence, layer).
- `prefill_end`: `inputs` = {q [Hq, w, D], k = cache.keys() [Hkv, T, D], v, attn}, `sym` =
  {context = prompt = T, layer, layers, heads, kv_heads, head_dim, step = 0}; the generated
  `prefill_end_scores` + `prefill_end_select` give the kept indices per KV head -> `KeepPlan`
  (with per-head `lengths` when the counts differ: head-adaptive selections such as Ada-KV; the
  counts are the selected tensors' sizes and stay on the host, so no device sync reads them).
- `release`: drops the sequence's buffers.
- `clone(src, dst)` (`Hook.CLONE`, every method with hooks): `dst` gets a copy (cloned tensors) of
  every per-(sequence, layer) entry `src` has: query windows, prefill accumulators, and the
  decode state and pending scores (`DecodeHooks._clone_decode`).
- `turn_end` / `turn_resume` (methods with per-token state, e.g. H2O's `seen`: `Hook.TURN`): the
  chain cache takes each layer's state with the session (the decode state, or the prefill
  accumulator of a prefill cut short) and gives it back, cut to the stored lengths, as the
  prefill accumulator of the continuation, which then grows it over the new suffix. Query
  windows are not carried over: a continued prefill observes its own suffix's queries.
- Keep plans carry `tail`: the keep's `+ last N` (manifest hook fact `last`), evaluated with the
  hook's symbols, so the chain cache knows which stored tokens are still verbatim.

A method with no hooks (`full`) gets an empty `hooks` set and `compacts = False`: the engine calls
nothing and prefix caching stays on.

Scoring runs on the cache's device. On a GPU, a hook the compiler fused into one Triton kernel
(manifest `kernels`: a prefill_end keep score, a prefill_chunk state accumulation) calls that kernel
(kernels_generated/<m>/triton_kernels.py), so no [head, query, key] matrix is materialised; the
rest of the generated torch lowering runs as torch ops on the same device. On the CPU the torch
lowering runs in float32.

Decode-time hooks (decode_after_attention / step_end evictions: H2O, TOVA, StreamingLLM) run
through `methods_compiled_decode.DecodeHooks`, mixed in here.

Attention: `attention` (`AttentionKernels`) exposes the manifest's `attention` entry, the variant
of the generated paged-attention kernels the method runs (`plain` for `full` and every method
that only reads the cache; `decode_stats` when decode_after_attention reads `attn`) and the fold
of the statistics those kernels emit; the triton backend loads that variant.

Budget: a layer holds as many slots as its most-keeping KV head keeps (per-head variable counts
are stored right-aligned in shared slots), so the steady state uses the generated `held_tokens`
bound (the compiler's formula; equal to `kept_tokens` unless the selection is head-adaptive),
bounded by the decode-time keep when there is one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvc.compiler import cache as method_cache
from kvc.runtime.primitives.torch_primitives import clamp_count
from kvc.dsl import METHODS_DIR, KvmError
from kvc.runtime.errors import ConfigError
from kvc.runtime.attention.metadata import StatsFold
from kvc.runtime.method_api import AttentionKernels, Hook, KeepPlan, MethodBase, PrefillView
from kvc.runtime.methods_compiled_decode import IN_PAGES, DecodeHooks, copy_entries

GENERATED = method_cache.GENERATED_DIR
ALL_QUERIES = -1


def _operand(t: torch.Tensor) -> torch.Tensor:
    """A scoring operand on its own device: float32 on the CPU (the reference precision), the
    cache's dtype on a GPU (the fused kernels multiply bf16 with float32 accumulation, the torch
    lowering upcasts itself)."""
    t = t.detach()
    return t.float() if t.device.type == "cpu" else t


def available() -> list[str]:
    """Shipped method names: generated folders and methods/*.kvm (compiled on start when stale)."""
    shipped = {p.parent.name for p in GENERATED.glob("*/manifest.json")}
    return sorted(shipped | {p.stem for p in METHODS_DIR.glob("*.kvm")})


def _locate(spec: str) -> method_cache.CompiledFolder | None:
    """The generated folder of a method name, compiled folder or .kvm path; user errors become `ConfigError`s."""
    try:
        return method_cache.locate(spec, generated=GENERATED)
    except FileNotFoundError:
        raise ConfigError(f"method file {spec!r} does not exist (give a shipped method name, the path of "
                          "a .kvm file or a folder compiled by `kvc compile FILE --out DIR`)", param="method") from None
    except method_cache.FolderError as e:
        raise ConfigError(e.message, param="method") from None
    except KvmError as e:
        raise ConfigError(f"method {spec!r} does not compile:\n{e}", param="method") from None
    except OSError as e:
        raise ConfigError(f"cannot compile method {spec!r} into {method_cache.cache_dir()}: {e}; set "
                          f"{method_cache.CACHE_ENV} to a writable folder", param="method") from None


def _check_params(name: str, manifest: dict, params: dict[str, Any], source: Path | None = None) -> dict[str, Any]:
    declared = manifest.get("parameters", {})
    unknown = sorted(set(params) - set(declared))
    if unknown:
        raise ConfigError(f"method {name!r} has no parameter(s) {', '.join(map(repr, unknown))}; "
                          f"its parameters: {', '.join(sorted(declared)) or 'none'}", param="method_params")
    try:
        from kvc.dsl import check_file

        if source is not None:
            check_file(source, dict(params))  # ranges and types, from the .kvm's declarations
    except ConfigError:
        raise
    except Exception as e:  # KvmError: a clear diagnostic pointing at the .kvm line
        raise ConfigError(f"method {name!r}: bad method_params {params!r}: {e}", param="method_params") from None
    return {**{k: v["default"] for k, v in declared.items()}, **params}


def _query_window(name: str, hooks_module: Any, params: dict[str, Any]) -> int:
    """How many trailing prompt queries prefill_end reads (ALL_QUERIES: every one): the generated
    `query_window(params)` of hooks.py (compiler/contract_code.py)."""
    window = _generated(name, hooks_module, "query_window")(params)
    return ALL_QUERIES if window is None else int(window)


def _generated(name: str, hooks_module: Any, attr: str) -> Any:
    """A function (or table) of the method's generated hooks.py; a folder from an older compiler lacks it."""
    value = getattr(hooks_module, attr, None)
    if value is None:
        raise ConfigError(f"the generated hooks.py of method {name!r} predates `{attr}`; run `kvc compile --all` (or "
                          "recompile the method's folder)", param="method")
    return value


def _fused_kernels(manifest: dict) -> dict[str, str]:
    """hook -> the fused kernel computing all of it: a prefill_end kernel that is the keep's whole
    score (not accumulating), or a prefill_chunk kernel that is the hook's only statement."""
    fused = {}
    for kernel in manifest.get("kernels", []):
        hook, flags = kernel.get("hook"), kernel.get("flags", {})
        if hook == "prefill_end" and not flags.get("ACCUMULATE", False):
            fused[hook] = kernel["name"]
        elif hook == "prefill_chunk" and flags.get("ACCUMULATE", False) and flags.get("WHOLE_HOOK", False):
            fused[hook] = kernel["name"]
    return fused


def _keep_plan(kept: list[torch.Tensor], device: torch.device) -> KeepPlan:
    """A `KeepPlan` without a device sync: the counts are the tensors' sizes (host facts), and
    per-head counts stay a CPU tensor, so the engine learns the layer's new physical length and
    start slots without reading the device (`KeepPlan.from_heads` would copy them to it)."""
    counts = [int(t.numel()) for t in kept]
    if len(set(counts)) <= 1:
        return KeepPlan(torch.stack(kept).to(device=device, dtype=torch.long))
    indices = torch.zeros((len(kept), max(counts)), dtype=torch.long, device=device)
    for head, t in enumerate(kept):
        indices[head, : counts[head]] = t
    return KeepPlan(indices, torch.tensor(counts, dtype=torch.long))


def _attention_kernels(name: str, manifest: dict) -> AttentionKernels:
    """The manifest's `attention` entry: the attention variant and the decode statistics it emits."""
    entry = manifest.get("attention")
    if entry is None:
        raise ConfigError(f"the generated manifest of method {name!r} predates attention variants; run "
                          "`kvc compile --all`", param="method")
    fold = entry.get("decode_stats")
    return AttentionKernels(entry["variant"], None if fold is None else StatsFold(fold["reduce"], fold["fn"]))


class CompiledBudget:
    """Peak: the whole prompt per layer; steady: the generated bound on a layer's physical length
    (its most-keeping KV head, `held_tokens`) + generated tokens."""

    def __init__(self, held_tokens, params: dict[str, Any], num_layers: int, num_kv_heads: int) -> None:
        self.held_tokens, self.params = held_tokens, params
        self.num_layers, self.num_kv_heads = num_layers, num_kv_heads
        self.decode_bound = None  # (prompt_len, physical, layer) -> the most a decode step holds

    def kept(self, prompt_len: int, layer: int) -> int:
        """Physical tokens (slots) layer `layer` holds at most after prefill end."""
        return min(prompt_len, int(self.held_tokens(prompt_len, layer, self.num_layers, self.num_kv_heads,
                                                    self.params)))

    def peak_tokens(self, prompt_len: int, layer: int) -> int:
        return prompt_len

    def steady_tokens(self, prompt_len: int, context_len: int, layer: int) -> int:
        """Tokens held at `context_len` by a request whose prefill compressed `prompt_len` tokens."""
        grown = self.kept(prompt_len, layer) + max(0, context_len - prompt_len)
        return grown if self.decode_bound is None else self.decode_bound(prompt_len, grown, layer)


class CompiledMethod(DecodeHooks, MethodBase):
    compacts = True
    fused_devices = ("cuda",)  # where the fused Triton kernels run (tests add "cpu" under TRITON_INTERPRET)
    QUERY_BLOCK_BYTES = 8 << 20  # the torch path's attention matrix per block of a chunk's queries

    def __init__(self, name: str, manifest: dict, params: dict[str, Any], folder: Path | None = None) -> None:
        self.name = name
        self.params = params
        folder = folder if folder is not None else GENERATED / name
        self.folder = folder
        self._source_sha256 = manifest.get("source_sha256", "")
        self.lowering = method_cache.load_module(folder, "torch_lowering")
        self.hooks_module = method_cache.load_module(folder, "hooks")
        self._chunk_hook = getattr(self.lowering, "prefill_chunk", None)
        self._chunk_params = tuple(getattr(self.lowering, "HOOK_PARAMS", {}).get("prefill_chunk", sorted(params)))
        self._scores = getattr(self.lowering, "prefill_end_scores", None)
        self._select = getattr(self.lowering, "prefill_end_select", None)
        facts = manifest.get("hooks", {})
        if self._scores is None and any(facts.values()):
            raise ConfigError(f"method {name!r} has decode-time or chunk hooks but no prefill_end selection; the "
                              "engine serves compiled methods whose compression starts at prefill end",
                              param="method")
        self.window = _query_window(name, self.hooks_module, params)
        hooks = {Hook.PREFILL_END, Hook.RELEASE} if self._scores is not None else set()
        if self._chunk_hook is not None or self.window != 0:  # per-chunk state or a query window
            hooks.add(Hook.PREFILL_CHUNK)
        self.states = list(getattr(self.lowering, "STATES", []))
        self._tails = _generated(name, self.hooks_module, "KEEP_TAILS")  # keeping hook -> its `+ last N`
        self._end_reads_v = "v" in facts.get("prefill_end", {}).get("inputs", ["v"])
        self._fused_names = _fused_kernels(manifest)
        self._fused: dict[str, Any] | None = None  # hook -> entry point of triton_kernels.py, on first GPU use
        self._q: dict[tuple[int, int], torch.Tensor] = {}  # (seq, layer) -> [Hq, <=w, D]
        self._state: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        held = getattr(self.hooks_module, "held_tokens", None)
        if held is None:
            raise ConfigError(f"kernels_generated/{name}/hooks.py predates the held_tokens budget; "
                              "run `kvc compile --all`", param="method")
        self.budget = CompiledBudget(held, params, 1, 1)
        self.attention = _attention_kernels(name, manifest)
        hooks |= self._init_decode(manifest)
        if self.states:  # per-sequence state that a chain must carry between turns
            hooks.add(Hook.TURN)
        if hooks:  # some per-sequence state may exist: a cloned sequence must get its copy
            hooks.add(Hook.CLONE)
        self.hooks = frozenset(hooks)
        self.compacts = bool(hooks)  # a method with no hooks (`full`) keeps every token: prefix caching stays on
        if Hook.STEP_END in hooks:
            self.budget.decode_bound = self.decode_bound
        # a chain prune's scorer: the prompt's keep scores (`token_scores`), reading the newest
        # `query_window` prefill queries (-1: every query, H2O's attention sums over the prompt)
        self.scores_tokens = self._scores is not None and hasattr(self.lowering, "score")
        self.query_window = -1 if self.window == ALL_QUERIES or (self.window == 0 and self._chunk_hook) else self.window
        self.tuned_kernels = frozenset({"compaction"} if self.compacts else ()) | (
            frozenset({"scores"}) if self._fused_names else frozenset())

    @property
    def fingerprint(self) -> str:
        """What makes two instances compute the same cache: the method, its parameters, and the
        generated code's source hash (prefix-cache salt; chain records will carry it too)."""
        params = ",".join(f"{k}={self.params[k]!r}" for k in sorted(self.params))
        return f"{self.name}({params})@{self._source_sha256}"

    def token_scores(self, layer: int, num_layers: int, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """The prompt's keep scores [Hkv, n] of keys k [Hkv, n, D] under queries q [Hq, w, D] (the
        generated `score`: a whole prompt's prefill_end scores)."""
        return self.lowering.score(q, k, layer=layer, num_layers=num_layers, params=self.params)

    def bind(self, num_layers: int, num_kv_heads: int) -> None:
        """The model's shape, for the budget formulas (called by the engine before admission)."""
        self.budget.num_layers, self.budget.num_kv_heads = num_layers, num_kv_heads

    def _kernel(self, hook: str, device: torch.device):
        """The fused Triton entry point computing `hook`'s scores (prefill_end) or state update
        (prefill_chunk) on a GPU, or None: on the CPU the torch lowering runs."""
        if device.type not in self.fused_devices or hook not in self._fused_names:
            return None
        if self._fused is None:
            kernels = method_cache.load_module(self.folder, "triton_kernels")
            self._fused = {h: getattr(kernels, name) for h, name in self._fused_names.items()}
        return self._fused[hook]

    def _new_state(self, kv_heads: int, device: torch.device) -> dict[str, torch.Tensor]:
        return {s: torch.zeros(kv_heads, 0, device=device) for s in self.states}

    def _sym(self, view: PrefillView, heads: int, kv_heads: int, head_dim: int, context: int) -> dict:
        return {"context": context, "prompt": context, "step": 0, "layer": view.layer,
                "layers": view.num_layers, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}

    def prefill_chunk(self, layer: int, view: PrefillView) -> None:
        key = (view.seq_id, layer)
        q = _operand(view.q.transpose(0, 1))  # [Hq, n, D]
        if view.start == 0:  # a new prefill (or a recompute): reset
            self._q.pop(key, None)
            self._state.pop(key, None)
        if self.window != 0:
            prev = self._q.get(key)
            q_all = q if prev is None else torch.cat([prev, q], dim=1)
            self._q[key] = (q_all if self.window == ALL_QUERIES else q_all[:, -self.window:]).contiguous()
        if self._chunk_hook is not None:
            shared = self._shared_chunk_key(layer, view)
            if shared is not None and shared in view.memo:  # another engine replaying this record computed it
                self._state[key] = {name: value.clone() for name, value in view.memo[shared].items()}
                return
            k = _operand(view.cache.keys())
            state = self._state.get(key)
            if state is None:
                stored = view.cache.length - view.q.shape[0]
                state = self._resumed_state(key, view.cache, stored) or self._new_state(k.shape[0], k.device)
            fused = self._kernel("prefill_chunk", k.device)
            if fused is not None:  # no [head, query, key] matrix in memory
                self._state[key] = fused(q, k, self.params, state)
            else:
                self._state[key] = self._chunk_in_blocks(view, q, k, state)
            if shared is not None:
                view.memo[shared] = {name: value.clone() for name, value in self._state[key].items()}

    def _shared_chunk_key(self, layer: int, view: PrefillView) -> tuple | None:
        """Where a replayed prefill's chunk state is shared: it depends on the recorded q/k (the
        record's memo), the generated code, the parameters the chunk hook reads (not a budget), the
        layer and the chunks so far; None when not replayed."""
        if view.memo is None:
            return None
        read = tuple((name, self.params[name]) for name in self._chunk_params)
        return ("prefill_chunk", self._source_sha256, read, layer, view.start, view.q.shape[0])

    def _chunk_in_blocks(self, view: PrefillView, q: torch.Tensor, k: torch.Tensor, state: dict) -> dict:
        """The torch path of a chunk hook, over blocks of the chunk's queries: each block is a
        smaller prefill chunk (its queries the newest positions of the keys up to it), which the
        contract already makes equivalent, since the engine may chunk a prompt anywhere. The
        [head, query, key] matrix of a block stays near `QUERY_BLOCK_BYTES`, instead of the whole
        chunk's (151 MB per layer for 2,048 queries over 2,048 keys at 9 heads, several passes each)."""
        heads, queries = q.shape[0], q.shape[1]
        length = k.shape[1]
        block = max(16, self.QUERY_BLOCK_BYTES // (4 * heads * length))
        for first in range(0, queries, block):
            last = min(queries, first + block)
            keys = k[:, : length - queries + last]
            attn = self.lowering._attention(q[:, first:last], keys, softmax=True)
            sym = self._sym(view, heads, k.shape[0], k.shape[-1], keys.shape[1])
            state = self._chunk_hook({"q": q[:, first:last], "k": keys, "v": None, "attn": attn}, state, sym,
                                     self.params)
        return state

    def prefill_end(self, layer: int, view: PrefillView) -> KeepPlan | None:
        key = (view.seq_id, layer)
        device = view.cache.device
        k = _operand(view.cache.keys())
        kv_heads, length = k.shape[0], k.shape[1]
        q = self._q.pop(key, None)
        if q is None:
            q = _operand(view.q.transpose(0, 1))
        state = (self._state.pop(key, None) or self._resumed_state(key, view.cache, length - view.q.shape[0])
                 or self._new_state(kv_heads, device))
        sym = self._sym(view, q.shape[0], kv_heads, k.shape[-1], length)
        starts = view.cache.starts
        if starts is not None:  # a layer stored with per-head counts (a continued chain of Ada-KV)
            scores = self._scores_per_head(view, q, k, state, sym, starts)
        else:
            scores = self._end_scores(view, q, k, state, sym)
        kept = self._select(scores, sym, self.params)
        if starts is not None:  # a head never keeps its padding slots (its floor may reach them)
            kept = [t[t >= start] for t, start in zip(kept, starts)]
        plan = None if all(int(t.numel()) >= length for t in kept) else _keep_plan(kept, device)
        if plan is not None:
            plan.tail = self.kept_tail("prefill_end", sym, length)
        self._decode_start(key, state, view.cache, plan)
        return plan

    def _end_scores(self, view: PrefillView, q, k, state, sym, heads: slice = slice(None), start: int = 0):
        """prefill_end's ranking scores [kv_head, key]: the fused kernel on a GPU, else the lowering
        (values are copied out of the pages only when the hook reads them)."""
        fused = self._kernel("prefill_end", k.device)
        if fused is not None:
            return fused(q, k, self.params, state)
        v = _operand(view.cache.values())[heads, start:] if self._end_reads_v else None
        return self._scores({"q": q, "k": k, "v": v}, state, sym, self.params)

    def _scores_per_head(self, view: PrefillView, q, k, state, sym, starts: list[int]) -> torch.Tensor:
        """Scores of a layer whose KV head h stores its tokens in slots [starts[h], length): each
        head is scored alone over its own tokens (its query group, its context), so padding takes
        no softmax mass and no pooling window; padding slots rank last (-inf)."""
        kv_heads, length = k.shape[0], k.shape[1]
        group = q.shape[0] // kv_heads
        if any(value.dim() == 2 and value.shape[-1] for value in state.values()):
            raise NotImplementedError(f"method {self.name!r}: per-token prefill state on a layer stored "
                                      "with per-head counts")
        scores = torch.full((kv_heads, length), float("-inf"), dtype=torch.float32, device=k.device)
        for head, start in enumerate(starts):
            own = k[head : head + 1, start:].contiguous()
            head_sym = {**sym, "context": length - start, "prompt": length - start, "heads": group, "kv_heads": 1}
            head_state = {name: value[head : head + 1] for name, value in state.items()}
            head_scores = self._end_scores(view, q[head * group : (head + 1) * group], own, head_state, head_sym,
                                           slice(head, head + 1), start)
            scores[head, start:] = head_scores[0].float()
        return scores

    def kept_tail(self, hook: str, sym: dict, length: int) -> int:
        """How many of the newest of `length` stored tokens `hook`'s keep always keeps (`+ last N`)."""
        tail = self._tails.get(hook)
        if tail is None:
            return 0
        return clamp_count(tail(sym, self.params), length)

    # ---- chain cache -------------------------------------------------------------------------
    def turn_end(self, seq_id: int) -> dict[int, dict[str, torch.Tensor] | str]:
        """Per layer, the sequence's per-token state (decode state, or a cut-short prefill's
        accumulator), or `IN_PAGES` where it is in the state planes of the pages the chain record
        keeps; the method forgets it."""
        state: dict[int, dict[str, torch.Tensor] | str] = {}
        for store in (self._state, self._decode_state):  # decode state wins: it is the newer
            for key in [key for key in store if key[0] == seq_id]:
                state[key[1]] = store.pop(key)
        state.update(self._layers_in_pages(seq_id))  # decode state in the planes stays in the record's pages
        self.release(seq_id)
        return state

    def turn_resume(self, seq_id: int, state: Any, lengths) -> None:
        """A chain's state becomes `seq_id`'s prefill accumulator (copied: forks share the record),
        cut to the physical `lengths` per layer (a rollback dropped the stored tail)."""
        self.release(seq_id)
        for layer, tensors in (state or {}).items():
            if tensors == IN_PAGES:
                self._resume_in_pages(seq_id, layer)
                continue
            self._state[seq_id, layer] = {
                name: (value[:, : lengths[layer]] if value.dim() == 2 else value).clone()
                for name, value in tensors.items()
            }

    def clone(self, src_seq_id: int, dst_seq_id: int) -> None:
        """`dst_seq_id` gets a copy of every per-layer entry of `src_seq_id` (cloned tensors)."""
        self.release(dst_seq_id)
        for store in (self._q, self._state):
            copy_entries(store, src_seq_id, dst_seq_id)
        self._clone_decode(src_seq_id, dst_seq_id)

    def release(self, seq_id: int) -> None:
        self._release_decode(seq_id)
        for store in (self._q, self._state):
            for key in [key for key in store if key[0] == seq_id]:
                del store[key]


def resolve_compiled(spec: str, params: dict[str, Any] | None) -> CompiledMethod:
    """A shipped method name, compiled folder or .kvm path -> the adapter over its (possibly just compiled) code."""
    compiled = _locate(spec)
    if compiled is None:
        names = available()
        raise ConfigError(f"unknown method {spec!r}; available: {', '.join(names)} (or the path of a .kvm "
                          "file or of a compiled folder)", param="method")
    manifest = compiled.manifest
    if not manifest.get("lowered", False):
        reason = manifest.get("reason", "no reason given")
        raise ConfigError(f"method {spec!r} is not lowered by the compiler yet: {reason}", param="method")
    name = manifest.get("method", spec)
    checked = _check_params(name, manifest, dict(params or {}), compiled.source)
    return CompiledMethod(name, manifest, checked, compiled.folder)
