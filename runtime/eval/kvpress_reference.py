"""`kvc eval --reference kvpress`: the eval's cases run through NVIDIA kvpress (ARCHITECTURE.md, oracle 3).

kvc eval scores each method against its KV budget; this module gives the same cases' answers from
an outside implementation, kvpress 0.5.5's presses on the same weights in transformers, so its
accuracy sits beside kvc's in one table. It is a reference adapter and
so necessarily names methods: `_PRESSES` maps a kvc method and its `method_params` to the press
running the same algorithm, with kvc's counts read from the compiled method (`kept_tokens`, the
keep's `+ last N`, the parameters with the .kvm's defaults):

- the budget becomes a compression ratio per prompt, chosen so that kvpress keeps exactly kvc's
  count of the T prompt tokens (`ratio_keeping`); a prompt within the budget runs uncompressed,
  which is `full`'s run;
- snapkv: `SnapKVPress(window_size=window, kernel_size=kernel)` (kvpress only average-pools);
- pyramidkv: kvc's integer per-layer schedule given to `PyramidKVPress` (`pyramid_press`, checked
  with `get_layer_budget`; where kvpress caps its bottom layer differently, the schedule is pinned);
- adakv: `AdaKVPress(SnapKVPress(...), alpha_safeguard=a)`, kvc's alpha (counted beyond the window)
  converted to kvpress's (counted with it, `adakv_safeguard`);
- tova: `TOVAPress`; streamingllm: `StreamingLLMPress(n_sink=sink)`, keeping kvc's sink + recent (or budget);
- h2o: `ColumnSumPress` (below), kvpress's observed attention as H2O's prefill selection, with
  kvc's heavy and recent counts (fractions of the prompt, or a token budget); eager attention;
- kvzip: `KVzipPress(compression_ratio=1 - ratio, chunk_size=chunk, n_sink=sink)`, one budget across
  layers as kvc's, reconstructing from after the chat template's user prefix only where the prompt opens
  with it (`FramedKVzipPress`; kvpress skips that many tokens of any prompt). Its prefill is kvpress's own
  (`with press(model): model.model(prompt)`: the prompt, then the press's context reconstruction passes,
  which leave the cache whole and each layer's pruned pairs in `masked_key_indices`, decoded masked as
  Ada-KV's); the repeat prompt comes from the model directory's tokenizer and chat template, as kvc's
  engine frames it.

Semantics: the whole prompt (question included, as kvc compresses it) is the press's context and is
compressed at the end of its prefill; the first token comes from the prefill's last logits, then
greedy decoding over the compressed cache, one token per forward at positions T, T+1, ... as
kvpress's pipeline decodes. kvpress compresses only at prefill: kvc's streamingllm, h2o and tova
also evict at every decode step, so over long answers their caches differ from kvpress's.

Sharing: a press compresses each layer's cache in a hook after that layer's attention, so the
prefill's hidden states do not depend on it. One forward per prompt and attention implementation
serves every configuration: a hook calls each press's `compress` with the arguments kvpress's own
`forward_hook` passes and keeps each result in that configuration's cache (two forwards at most:
H2O's press reads the attention matrix, which only eager attention returns, and Ada-KV refuses
eager). Decoding is batched where it is exact: configurations of one prompt whose caches have the
same length in every layer (e.g. snapkv, tova and streamingllm at one budget; Ada-KV's masked
full-length caches and `full`) are stacked in the batch dimension, Ada-KV's masked key indices
moved to their rows; batched rows can differ from a lone decode in the last bits of a float (other
matrix shapes), not in what is computed. Rows that stop early ride along until the batch ends.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from kvc.runtime.errors import ConfigError, PromptTooLongError

log = logging.getLogger(__name__)

KVPRESS_MISSING = "--reference kvpress needs kvpress: pip install kvpress==0.5.5 (it needs transformers < 5.3)"


@dataclass(frozen=True)
class ReferencePrompt:
    prompt: tuple[int, ...]  # token ids
    max_tokens: int
    stop_token_ids: tuple[int, ...]  # generation also stops at the model's eos ids


def _kvpress() -> Any:
    """kvpress, imported on first use (importing it patches transformers' attention functions)."""
    try:
        import kvpress
    except ImportError:
        raise ConfigError(KVPRESS_MISSING, param="reference") from None
    return kvpress


# ---- kvc's counts -> kvpress's parameters ------------------------------------------------------------


def ratio_keeping(length: int, kept: int) -> float:
    """A kvpress compression ratio that keeps exactly `kept` of `length` tokens."""
    from_ratio = _kvpress().utils.compute_n_kept
    ratio = 1 - (kept + 0.5) / length
    if from_ratio(length, ratio) != kept:
        raise RuntimeError(f"no kvpress ratio keeps {kept} of {length} tokens (got {ratio})")
    return ratio


def pyramid_press(schedule: list[int], length: int, window: int, kernel: int) -> Any:
    """A PyramidKVPress whose per-layer budgets are kvc's `schedule` (window included): kvpress
    draws a line from 2c - c/beta (bottom) to c/beta (top) in real numbers, so c = (bottom + top) / 2
    and beta = c / top reproduce kvc's integer line unless kvpress caps its bottom at T - window."""
    bottom, top = schedule[0], schedule[-1]
    c = (bottom + top) / 2
    return _kvpress().PyramidKVPress(1 - c / length, window_size=window, kernel_size=kernel, beta=c / top)


def _safeguard_beyond_window(n_kept: int, window: int, alpha_safeguard: float) -> int:
    """Tokens kvpress's Ada-KV safeguard forces per head outside the window: it forces the head's
    max(1, int(a * n_kept)) best, and the window's scores are above all others."""
    return max(0, max(1, int(alpha_safeguard * n_kept)) - window)


def adakv_params(budget: int, window: int, kernel: int, alpha_safeguard: float) -> dict[str, Any]:
    """kvc's method_params for kvpress's AdaKV: the safeguard moved outside the window
    (kvc's alpha forces floor(alpha * (budget - window)) tokens beyond it)."""
    extra = _safeguard_beyond_window(budget, window, alpha_safeguard)
    alpha = min(1.0, (extra + 0.5) / (budget - window))
    if math.floor(alpha * (budget - window)) != extra:
        raise RuntimeError(f"no kvc alpha forces {extra} of {budget - window} tokens")
    return {"budget": budget, "window": window, "kernel": kernel, "alpha": alpha}


def adakv_safeguard(budget: int, window: int, alpha: float) -> float:
    """kvpress's alpha_safeguard for kvc's Ada-KV (the inverse of `adakv_params`): it forces the
    window and floor(alpha * (budget - window)) more per head, counted with the window."""
    extra = max(0, math.floor(alpha * (budget - window)))
    safeguard = min(1.0, (window + extra + 0.5) / budget)
    if _safeguard_beyond_window(budget, window, safeguard) != extra:
        raise RuntimeError(f"no kvpress alpha_safeguard forces {extra} tokens beyond a {window}-token window")
    return safeguard


@cache
def _press_classes() -> dict[str, type]:
    """The presses this module adds to kvpress, built on first use (they subclass kvpress's)."""
    kvpress = _kvpress()

    @dataclass
    class ColumnSumPress(kvpress.ObservedAttentionPress):
        """kvpress's observed attention turned into H2O's prefill selection: summed attention (not the
        average over the T - j queries that see key j), the last `recent` tokens always kept."""

        recent: int = 0

        def score(self, module, hidden_states, keys, values, attentions, kwargs) -> torch.Tensor:
            scores = super().score(module, hidden_states, keys, values, attentions, kwargs)
            length = scores.shape[-1]
            scores = scores * torch.arange(length, 0, -1, dtype=scores.dtype, device=scores.device)
            if self.recent:
                scores[..., length - self.recent :] = scores.max() + 1  # kvpress's way of forcing a window
            return scores

    @dataclass
    class PinnedPyramidKVPress(kvpress.PyramidKVPress):
        """PyramidKV with kvc's per-layer budgets given outright, where kvpress's own line from
        (ratio, beta) cannot reach them (it caps its bottom layer at T - window, kvc at T)."""

        schedule: tuple[int, ...] = ()

        def get_layer_budget(self, module, q_len: int) -> int:
            return self.schedule[module.layer_idx]

    @dataclass
    class FramedKVzipPress(kvpress.KVzipPress):
        """KVzipPress reconstructing the context from after the chat template's user-turn prefix only where
        the prompt opens with it, as kvc frames the replay (runtime/context_replay.py). kvpress assumes a
        templated prompt and skips that prefix's length from any prompt: a raw one (the eval's tasks) would
        lose its first tokens' scores, and those tokens, to the assumption."""

        def prepare(self, model, tokenizer, prev_postfix_size=8):
            from kvc.runtime.context_replay import frame

            prefix = frame(tokenizer)[0]
            if self._context_ids[0, : len(prefix)].tolist() != prefix:
                self.prefix_length = 0
            return super().prepare(model, tokenizer, prev_postfix_size)

    return {"ColumnSumPress": ColumnSumPress, "PinnedPyramidKVPress": PinnedPyramidKVPress,
            "FramedKVzipPress": FramedKVzipPress}


def __getattr__(name: str) -> type:
    """The presses of `_press_classes` import kvpress only when first asked for."""
    if name in ("ColumnSumPress", "PinnedPyramidKVPress", "FramedKVzipPress"):
        return _press_classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class _Prompt:
    """What a press is configured from: the prompt's length and kvc's counts for it."""

    length: int
    kept: list[int]  # kvc's tokens kept per KV head, per layer (Ada-KV: the average over heads)
    params: dict[str, Any]
    recent: int  # the keep's `+ last N` (H2O's recent window)


def _avg_pooling(name: str, params: dict[str, Any]) -> None:
    if params.get("pooling", "avg") != "avg":
        raise ConfigError(f"--reference kvpress: kvpress's {name} only average-pools; method_params has pooling="
                          f"{params['pooling']!r}", param="method_params")


def _snapkv(p: _Prompt) -> Any:
    _avg_pooling("SnapKVPress", p.params)
    window = {"window_size": p.params["window"], "kernel_size": p.params["kernel"]}
    return _kvpress().SnapKVPress(ratio_keeping(p.length, p.kept[0]), **window)


def _pyramidkv(p: _Prompt) -> Any:
    if len(set(p.kept)) == 1:  # kvc's short-prompt fallback: SnapKV's uniform budget
        return _snapkv(p)
    _avg_pooling("PyramidKVPress", p.params)
    window, kernel = p.params["window"], p.params["kernel"]
    press = pyramid_press(p.kept, p.length, window, kernel)
    layers = [SimpleNamespace(layer_idx=i, config=SimpleNamespace(num_hidden_layers=len(p.kept)))
              for i in range(len(p.kept))]
    if [press.get_layer_budget(layer, p.length) for layer in layers] == p.kept:
        return press
    return _press_classes()["PinnedPyramidKVPress"](press.compression_ratio, window_size=window, kernel_size=kernel,
                                                    schedule=tuple(p.kept))


def _adakv(p: _Prompt) -> Any:
    kvpress, budget, window = _kvpress(), p.kept[0], p.params["window"]
    inner = kvpress.SnapKVPress(ratio_keeping(p.length, budget), window_size=window, kernel_size=p.params["kernel"])
    return kvpress.AdaKVPress(inner, alpha_safeguard=adakv_safeguard(budget, window, p.params["alpha"]))


def _tova(p: _Prompt) -> Any:
    return _kvpress().TOVAPress(ratio_keeping(p.length, p.kept[0]))


def _streamingllm(p: _Prompt) -> Any:
    return _kvpress().StreamingLLMPress(ratio_keeping(p.length, p.kept[0]), n_sink=p.params["sink"])


def _h2o(p: _Prompt) -> Any:
    return _press_classes()["ColumnSumPress"](ratio_keeping(p.length, p.kept[0]), recent=p.recent)


def _kvzip(p: _Prompt) -> Any:
    # its cost warning (2-3x a prefill) comes once per press, so once per prompt: said once by the eval's docs
    logging.getLogger("kvpress.presses.kvzip_press").setLevel(logging.ERROR)
    return _press_classes()["FramedKVzipPress"](compression_ratio=1 - p.params["ratio"],
                                                chunk_size=p.params["chunk"], n_sink=p.params["sink"])


# kvc method -> (the press for one prompt, the attention implementation it runs with)
_PRESSES: dict[str, tuple[Callable[[_Prompt], Any], str]] = {
    "snapkv": (_snapkv, "sdpa"),
    "pyramidkv": (_pyramidkv, "sdpa"),
    "adakv": (_adakv, "sdpa"),  # AdaKVPress refuses eager
    "tova": (_tova, "sdpa"),
    "streamingllm": (_streamingllm, "sdpa"),
    "h2o": (_h2o, "eager"),  # ColumnSumPress reads the attention matrix
    "kvzip": (_kvzip, "sdpa"),  # its own prefill (`replayed`): reconstruction passes after the prompt
}
FULL = "full"


def kvpress_methods() -> tuple[str, ...]:
    """kvc method names kvpress has an equivalent for (`full`: no press)."""
    return (FULL, *sorted(_PRESSES))


@dataclass(frozen=True)
class ReferenceMethod:
    """One configuration: kvc's compiled method (for its counts) bound to the model's shape."""

    name: str
    method: Any  # kvc.runtime.compiled.method.CompiledMethod
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def counts(self, length: int) -> _Prompt:
        """kvc's counts for a `length`-token prompt: kept tokens per layer and the keep's tail."""
        m, params = self.method, self.method.params
        kept = [int(m.hooks_module.kept_tokens(length, layer, self.num_layers, self.num_kv_heads, params))
                for layer in range(self.num_layers)]
        sym = {"context": length, "prompt": length, "step": 0, "layer": 0, "layers": self.num_layers,
               "heads": self.num_heads, "kv_heads": self.num_kv_heads, "head_dim": self.head_dim}
        return _Prompt(length, kept, params, m.kept_tail("prefill_end", sym, length))

    def press(self, length: int) -> tuple[Any | None, str]:
        """The press for a `length`-token prompt and its attention; None: nothing to compress."""
        if self.name == FULL:
            return None, "sdpa"
        counts = self.counts(length)
        if min(counts.kept) >= length:  # within the budget: kvc keeps every token, as `full` does
            return None, "sdpa"
        build, attention = _PRESSES[self.name]
        return build(counts), attention


def reference_methods(configs: list[tuple[str, dict]], model_config: Any) -> list[ReferenceMethod]:
    """kvc's methods for `configs`, parameters checked; a method kvpress lacks is a `ConfigError`."""
    from kvc.runtime.methods import resolve_method
    from kvc.runtime.models.layers import head_dim_of

    unknown = sorted({name for name, _ in configs if name not in kvpress_methods()})
    if unknown:
        raise ConfigError(f"--reference kvpress: kvpress has no equivalent of {', '.join(map(repr, unknown))}; it "
                          f"runs {', '.join(kvpress_methods())}", param="reference")
    layers, heads = model_config.num_hidden_layers, model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    out = []
    for name, params in configs:
        method = resolve_method(name, dict(params))
        method.bind(layers, kv_heads)
        out.append(ReferenceMethod(name, method, layers, heads, kv_heads, head_dim_of(model_config)))
    return out


# ---- one shared prefill, batched greedy decoding --------------------------------------------------------


@dataclass
class CompressedCache:
    """One configuration's cache of one prompt: K/V [1, Hkv, n, D] per layer and, for Ada-KV, the
    (batch, head, token) indices it masks at decode (kvpress's `module.masked_key_indices`)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    masked: list[tuple[torch.Tensor, ...] | None]

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(k.shape[2] for k in self.keys)


def _attention_modules(model: Any) -> list[torch.nn.Module]:
    return [layer.self_attn for layer in model.model.layers]


def prefill(model: Any, prompt: torch.Tensor, presses: dict[int, Any | None]
            ) -> tuple[torch.Tensor, dict[int, CompressedCache]]:
    """One forward of `prompt` [T]: its last logits and, per key, the cache its press leaves (None:
    the whole cache). Each layer's hook calls every press's `compress` on that layer's full K/V, with
    what kvpress's `BasePress.forward_hook` passes; the model's own cache stays whole."""
    from kvpress.utils import extract_keys_and_values
    from transformers import DynamicCache

    modules = _attention_modules(model)
    caches = {key: CompressedCache([], [], []) for key in presses}
    for press in {id(p): p for p in presses.values() if p is not None}.values():
        press.post_init_from_model(model)

    def compress_all(module: torch.nn.Module, args: Any, kwargs: dict, output: Any) -> Any:
        keys, values = extract_keys_and_values(kwargs["past_key_values"], module.layer_idx)
        for key, press in presses.items():
            module.masked_key_indices = None
            k, v = (keys, values) if press is None else press.compress(
                module, kwargs["hidden_states"], keys, values, output[1], kwargs)
            caches[key].keys.append(k)
            caches[key].values.append(v)
            caches[key].masked.append(getattr(module, "masked_key_indices", None))  # Ada-KV sets it
        module.masked_key_indices = None
        return output

    hooks = []
    try:
        for module in modules:
            module.rotary_emb = model.model.rotary_emb  # as `BasePress.__call__` sets it
            hooks.append(module.register_forward_hook(compress_all, with_kwargs=True))
        with torch.no_grad():
            out = model(input_ids=prompt[None], past_key_values=DynamicCache(), logits_to_keep=1)
    finally:
        for hook in hooks:
            hook.remove()
    return out.logits[0, -1], caches


def replayed(model: Any, prompt: torch.Tensor, press: Any) -> tuple[torch.Tensor, CompressedCache]:
    """KVzip's prefill through kvpress's own path: the prompt under `press(model)`, whose exit replays the
    context and scores it; its last logits and the whole cache with each layer's pruned pairs masked."""
    from kvpress.utils import extract_keys_and_values
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad(), press(model):
        hidden = model.model(input_ids=prompt[None], past_key_values=cache).last_hidden_state
    with torch.no_grad():
        logits = model.lm_head(hidden[0, -1])
    out = CompressedCache([], [], [])
    for module in _attention_modules(model):
        keys, values = extract_keys_and_values(cache, module.layer_idx)
        out.keys.append(keys)
        out.values.append(values)
        out.masked.append(getattr(module, "masked_key_indices", None))
        module.masked_key_indices = None
    return logits, out


def _replays(press: Any) -> bool:
    """A press that compresses by replaying the context after the prefill (KVzip), not in a hook."""
    return isinstance(press, _kvpress().KVzipPress)


def _stacked(rows: list[CompressedCache]) -> tuple[Any, list[tuple[torch.Tensor, ...] | None]]:
    """One DynamicCache with `rows` in the batch dimension, and each layer's masked indices with
    their batch index moved to the row's."""
    from transformers import DynamicCache

    cache = DynamicCache()
    masks: list[tuple[torch.Tensor, ...] | None] = []
    for layer in range(len(rows[0].keys)):
        cache.update(torch.cat([r.keys[layer] for r in rows]), torch.cat([r.values[layer] for r in rows]), layer)
        parts = [(i, r.masked[layer]) for i, r in enumerate(rows) if r.masked[layer] is not None]
        if not parts:
            masks.append(None)
            continue
        heads = torch.cat([m[1] for _, m in parts])
        tokens = torch.cat([m[2].to(heads.device) for _, m in parts])
        batch = torch.cat([torch.full_like(m[1], i) for i, m in parts])
        masks.append((batch, heads, tokens))
    return cache, masks


def greedy(model: Any, rows: list[CompressedCache], first: int, length: int, max_tokens: int,
           stops: set[int]) -> list[list[int]]:
    """Greedy tokens of each cache in `rows` (equal lengths per layer), decoded together from the
    prefill's token `first` at positions length, length + 1, ...; a stop token ends a row, included."""
    cache, masks = _stacked(rows)
    modules = _attention_modules(model)
    tokens = [[first] for _ in rows]
    done = [first in stops or max_tokens <= 1 for _ in rows]
    device = rows[0].keys[0].device
    try:
        for module, mask in zip(modules, masks):
            module.masked_key_indices = mask
        step = 0
        while not all(done):
            ids = torch.tensor([[t[-1]] for t in tokens], device=device)
            position = torch.full((len(rows), 1), length + step, device=device)
            with torch.no_grad():
                logits = model(input_ids=ids, past_key_values=cache, position_ids=position).logits[:, -1]
            for row, token in enumerate(logits.argmax(dim=-1).tolist()):
                if not done[row]:
                    tokens[row].append(token)
                    done[row] = token in stops or len(tokens[row]) >= max_tokens
            step += 1
    finally:
        for module in modules:
            module.masked_key_indices = None
    return tokens


def run_on_model(model: Any, prompts: list[ReferencePrompt], methods: list[ReferenceMethod],
                 eos_token_ids: tuple[int, ...] = (), progress: Callable[[int, int], None] | None = None
                 ) -> dict[int, list[list[int]]]:
    """`run_kvpress` on a loaded model (its attention implementation is switched as needed)."""
    original = model.config._attn_implementation
    room = getattr(model.config, "max_position_embeddings", None) or math.inf
    device = next(model.parameters()).device
    results: dict[int, list[list[int]]] = {i: [] for i in range(len(methods))}
    try:
        for done, case in enumerate(prompts, 1):
            length = len(case.prompt)
            max_tokens = min(case.max_tokens, room - length)  # kvc stops a sequence at the model's length too
            if max_tokens < 1:
                raise PromptTooLongError(f"--reference kvpress: a {length}-token prompt leaves no room for a token "
                                         f"in the model's {room} positions", param="prompt")
            stops = set(case.stop_token_ids) | set(eos_token_ids)
            by_attention: dict[str, dict[int, Any]] = defaultdict(dict)
            for i, method in enumerate(methods):
                press, attention = method.press(length)
                by_attention[attention][i] = press
            tokens: dict[int, list[int]] = {}
            for attention, presses in sorted(by_attention.items(), reverse=True):  # sdpa, then eager
                model.set_attn_implementation(attention)
                ids = torch.tensor(case.prompt, device=device)
                hooked = {i: press for i, press in presses.items() if not _replays(press)}
                caches, firsts = {}, {}
                if hooked:
                    logits, caches = prefill(model, ids, hooked)
                    firsts = dict.fromkeys(caches, int(logits.argmax()))
                for i in presses.keys() - hooked.keys():
                    logits, caches[i] = replayed(model, ids, presses[i])
                    firsts[i] = int(logits.argmax())
                same_shape: dict[tuple, list[int]] = defaultdict(list)
                for i, compressed in caches.items():
                    same_shape[compressed.lengths, firsts[i]].append(i)
                for (_, first), group in same_shape.items():
                    rows = greedy(model, [caches[i] for i in group], first, length, max_tokens, stops)
                    tokens.update(zip(group, rows))
                del caches
            for i, per_prompt in results.items():
                per_prompt.append(tokens[i])
            if progress is not None:
                progress(done, len(prompts))
    finally:
        model.set_attn_implementation(original)
    return results


def run_kvpress(model_dir: str | Path, prompts: list[ReferencePrompt], configs: list[tuple[str, dict]],
                device: str = "cpu", progress: Callable[[int, int], None] | None = None,
                dtype: torch.dtype | None = None) -> dict[int, list[list[int]]]:
    """Greedy tokens of every prompt under every (kvc method, method_params) configuration, run by
    kvpress's presses on `model_dir`'s weights in transformers: config index -> tokens per prompt.
    `dtype` None: kvc's default (float32 on the CPU, the checkpoint's dtype elsewhere).
    `progress(done, total)` is called after each prompt."""
    model, eos = load_reference_model(model_dir, device, dtype)
    return run_on_model(model, prompts, reference_methods(configs, model.config), eos, progress)


def load_reference_model(model_dir: str | Path, device: str = "cpu",
                         dtype: torch.dtype | None = None) -> tuple[Any, tuple[int, ...]]:
    """The Hugging Face model kvpress runs on (sdpa attention; the shared prefill switches to eager
    where a press needs it) and its end-of-generation ids, loaded once for many `run_on_model` calls."""
    _kvpress()
    from kvc.runtime.models.registry import default_dtype, eos_ids_of
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    try:
        model_config = AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--reference kvpress: cannot read {model_dir}: {e}", param="model") from None
    target = torch.device(device)
    dtype = dtype or default_dtype(model_config, target)
    log.info("kvpress reference: loading %s (%s, %s)", model_dir, target, dtype)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # its per-tensor loading bar: thousands of lines in a log
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    model = model.to(target).eval()
    try:
        generation = GenerationConfig.from_pretrained(model_dir)
    except OSError:
        generation = None
    return model, eos_ids_of(model_config, *([generation] if generation is not None else []))
