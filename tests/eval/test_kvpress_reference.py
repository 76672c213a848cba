"""`kvc eval --reference kvpress` (runtime/eval/kvpress_reference.py), on tiny random Llama and Qwen3.

- the shared run (one prefill per prompt and attention implementation, decoding batched over caches
  of equal shape) gives every configuration exactly the tokens its press gives alone through
  kvpress's standard path (`with press(model): model(prompt)`, then greedy one token per forward);
- the mapping keeps kvc's counts: each layer's cache length per KV head (PyramidKV's schedule
  included) and Ada-KV's per-layer total are the ones kvc's engine keeps for the same prompt;
- `full` is transformers' greedy `generate`; stop tokens end one row of a batch, the rest go on;
- a method kvpress lacks, a max-pooling SnapKV or a missing kvpress are `ConfigError`s.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from kvc.runtime.errors import ConfigError
from kvc.runtime.eval import kvpress_reference as ref
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, PreTrainedModel

from tests.models.tiny import make_tiny_llama, make_tiny_qwen3
from tests.references.kvpress_runner import _match_rows

needs_kvpress = pytest.mark.skipif(importlib.util.find_spec("kvpress") is None,
                                   reason="kvpress (the test extra) is not installed; 0.5.5 needs transformers < 5.3")

LENGTHS = (90, 160)
MAX_TOKENS = 6
# Budgets small enough to compress both prompts, except where a comment says otherwise.
CONFIGS: list[tuple[str, dict[str, Any]]] = [
    ("full", {}),
    ("snapkv", {"budget": 32, "window": 8}),  # 1-3: 32 tokens per layer, decoded as one batch
    ("tova", {"budget": 32}),
    ("streamingllm", {"sink": 4, "recent": 28}),
    ("pyramidkv", {"budget": 32, "window": 8, "beta": 2}),  # [44, 36, 28, 20]: kvpress's own line
    ("pyramidkv", {"budget": 48, "window": 16}),  # bottom 79 > 90 - 16: kvpress would cap it, pinned
    ("adakv", {"budget": 32, "window": 8, "alpha": 0.5}),  # 6, 7: masked, batched with `full`
    ("adakv", {"budget": 40, "window": 8}),
    ("h2o", {"heavy": 0.2, "recent": 0.1}),  # eager attention: the second prefill
    ("streamingllm", {"sink": 4, "recent": 120}),  # keeps all of the 90-token prompt
    ("h2o", {"heavy": 0.5, "recent": 0.5}),  # keeps every token: `full`'s run
    ("streamingllm", {"budget": 32}),  # kvc's token budgets: 4 sinks + 28 recent, batched with 1-3
    ("h2o", {"budget": 41}),  # 20 heavy hitters + 21 recent
]


def prompts_of(lengths: tuple[int, ...], seed: int, max_tokens: int = MAX_TOKENS,
               stops: tuple[int, ...] = ()) -> list[ref.ReferencePrompt]:
    g = torch.Generator().manual_seed(seed)
    return [ref.ReferencePrompt(tuple(torch.randint(3, 300, (n,), generator=g).tolist()), max_tokens, stops)
            for n in lengths]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices: a second intra-op thread only spins, badly so on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        return make_tiny_llama(root, seed=1, num_hidden_layers=4, num_attention_heads=8)
    return make_tiny_qwen3(root, seed=2, num_hidden_layers=4)


_hf: dict[tuple[Path, str], PreTrainedModel] = {}


def hf_model(path: Path, attention: str) -> PreTrainedModel:
    if (path, attention) not in _hf:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attention)
        _hf[path, attention] = model.eval()
    return _hf[path, attention]


def methods_for(model_dir: Path, configs: list[tuple[str, dict]]) -> list[ref.ReferenceMethod]:
    return ref.reference_methods(configs, AutoConfig.from_pretrained(model_dir))


def eos_of(model: PreTrainedModel) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos])


def alone(model: PreTrainedModel, press: Any, case: ref.ReferencePrompt) -> list[int]:
    """kvpress's standard path for one press: the prompt prefilled under `press(model)` (the press's
    own hooks compress the cache), greedy from its last logits, one token per forward at T, T+1, ..."""
    for layer in model.model.layers:
        layer.self_attn.masked_key_indices = None  # left over from an earlier Ada-KV run on this model
    cache, length = DynamicCache(), len(case.prompt)
    stops = set(case.stop_token_ids) | eos_of(model)
    with torch.no_grad():
        with press(model) if press is not None else contextlib.nullcontext():
            out = model(input_ids=torch.tensor([case.prompt]), past_key_values=cache, logits_to_keep=1)
        tokens = [int(out.logits[0, -1].argmax())]
        while tokens[-1] not in stops and len(tokens) < case.max_tokens:
            position = torch.tensor([[length + len(tokens) - 1]])
            out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache, position_ids=position)
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


class ForwardLog:
    """The (batch, query length) of every forward of a model, to see what was shared."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.shapes: list[tuple[int, int]] = []
        self.hook = model.register_forward_pre_hook(self.record, with_kwargs=True)

    def record(self, module, args, kwargs) -> None:
        self.shapes.append(tuple(kwargs["input_ids"].shape))


@needs_kvpress
def test_shared_run_is_each_press_alone(model_dir: Path) -> None:
    prompts = prompts_of(LENGTHS, seed=31)
    methods = methods_for(model_dir, CONFIGS)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    forwards = ForwardLog(model)
    shared = ref.run_on_model(model, prompts, methods, tuple(eos_of(model)))
    forwards.hook.remove()

    kinds = set()
    for i, method in enumerate(methods):
        for p, case in enumerate(prompts):
            press, attention = method.press(len(case.prompt))
            kinds.add(type(press).__name__)
            theirs = alone(hf_model(model_dir, attention), press, case)
            assert shared[i][p] == theirs, f"{CONFIGS[i]}, {len(case.prompt)}-token prompt"
    assert kinds == {"NoneType", "SnapKVPress", "TOVAPress", "StreamingLLMPress", "PyramidKVPress",
                     "PinnedPyramidKVPress", "AdaKVPress", "ColumnSumPress"}
    assert shared[10] == shared[0], "a press that keeps every token is `full`"
    assert shared[9][0] == shared[0][0], "streamingllm keeps the whole 90-token prompt"
    compressed = [i for i in [*range(1, 9), 11, 12] if shared[i] != shared[0]]
    assert len(compressed) >= 4, f"compression changed only configs {compressed}: the prompts pin too little"

    prefills = [shape for shape in forwards.shapes if shape[1] > 1]
    assert prefills == [(1, n) for n in LENGTHS for _ in range(2)], "one sdpa and one eager prefill per prompt"
    batches = {shape[0] for shape in forwards.shapes if shape[1] == 1}
    # 4: snapkv, tova, streamingllm x2 at 32 tokens; 5 / 4: full, adakv x2, uncompressed h2o (and streamingllm)
    assert {4, 5} <= batches and max(batches) == 5, batches


def kept_indices(compressed: ref.CompressedCache, whole: ref.CompressedCache, layer: int) -> list[torch.Tensor]:
    """The prompt positions each KV head of `layer` keeps: the complement of Ada-KV's masked
    tokens, else each compressed key row matched to its row of the whole cache."""
    keys, masked = whole.keys[layer][0], compressed.masked[layer]
    if masked is not None:
        keep = torch.ones(keys.shape[:2], dtype=torch.bool)
        keep[masked[1], masked[2]] = False
        return [keep[h].nonzero().flatten() for h in range(keys.shape[0])]
    return [_match_rows(compressed.keys[layer][0, h], keys[h]) for h in range(keys.shape[0])]


@pytest.mark.slow
@needs_kvpress
def test_kept_tokens_are_kvc_engines(model_dir: Path) -> None:
    """Per layer and KV head, the presses keep the tokens kvc's engine keeps for the same prompt
    (so its counts: PyramidKV's schedule, Ada-KV's per-layer total, H2O's recent window)."""
    from tests.runtime.served import make_llm, serve

    prompts = prompts_of(LENGTHS, seed=32)
    configs = [c for c in CONFIGS if c[0] != "full"]
    methods = methods_for(model_dir, configs)
    model = hf_model(model_dir, "sdpa")
    pinned = ragged = 0
    for (name, params), method in zip(configs, methods):
        llm = make_llm(model_dir, name, params, page_size=7, chunk=None)
        for served, case in zip(serve(llm, [list(p.prompt) for p in prompts], 1), prompts):
            length = len(case.prompt)
            where = f"{name} {params}, {length}-token prompt"
            press, attention = method.press(length)
            pinned += type(press).__name__ == "PinnedPyramidKVPress"
            model.set_attn_implementation(attention)
            try:
                _, caches = ref.prefill(model, torch.tensor(case.prompt), {0: press, 1: None})
            finally:
                model.set_attn_implementation("sdpa")
            for layer, engine in enumerate(served.kept):
                theirs = kept_indices(caches[0], caches[1], layer)
                assert [t.tolist() for t in theirs] == [t.tolist() for t in engine], f"{where} layer {layer}"
                if name == "adakv":
                    assert sum(len(t) for t in theirs) == len(theirs) * params["budget"], where
                    ragged += len({len(t) for t in theirs}) > 1
    assert pinned == 1, "the pinned PyramidKV schedule was not exercised"
    assert ragged > 0, "no Ada-KV layer kept unequal counts per head"


@needs_kvpress
def test_full_is_transformers_greedy(model_dir: Path) -> None:
    prompts = prompts_of(LENGTHS, seed=33, max_tokens=10)
    tokens = ref.run_kvpress(model_dir, prompts, [("full", {})])
    model = hf_model(model_dir, "sdpa")
    for case, ours in zip(prompts, tokens[0]):
        out = model.generate(torch.tensor([case.prompt]), max_new_tokens=case.max_tokens, do_sample=False)
        assert ours == out[0, len(case.prompt):].tolist()


@needs_kvpress
def test_stop_token_ends_its_row_only(model_dir: Path) -> None:
    configs = CONFIGS[:4]  # full, and snapkv / tova / streamingllm decoded in one batch
    prompts = prompts_of(LENGTHS[:1], seed=34, max_tokens=8)
    free = ref.run_kvpress(model_dir, prompts, configs)
    rows = [free[i][0] for i in range(len(configs))]
    stop = next(t for t in rows[1][1:] if any(t not in row for row in rows[2:]))  # ends snapkv, not all
    stopped = ref.run_kvpress(model_dir, [ref.ReferencePrompt(prompts[0].prompt, 8, (stop,))], configs)
    for i, row in enumerate(rows):
        expected = row[: row.index(stop) + 1] if stop in row else row
        assert stopped[i][0] == expected, configs[i]
    assert any(len(stopped[i][0]) == 8 for i in range(2, 4)), "no row of the batch went on"


@needs_kvpress
def test_generation_ends_at_the_models_length(model_dir: Path) -> None:
    """As kvc's engine: prompt + generated tokens stay within max_position_embeddings (512 here)."""
    from kvc.runtime.errors import PromptTooLongError

    near, over = prompts_of((508,), seed=36, max_tokens=10)[0], prompts_of((512,), seed=36)[0]
    tokens = ref.run_kvpress(model_dir, [near], [("snapkv", {"budget": 64, "window": 8})])[0][0]
    assert len(tokens) == 4 or (len(tokens) < 4 and tokens[-1] in eos_of(hf_model(model_dir, "sdpa")))
    with pytest.raises(PromptTooLongError, match="512-token prompt"):
        ref.run_kvpress(model_dir, [over], [("full", {})])


@needs_kvpress
def test_token_budgets(model_dir: Path) -> None:
    """H2O's and StreamingLLM's integer `budget` (H2O: budget // 2 heavy hitters + the rest recent;
    StreamingLLM: the sinks + budget - sink recent) reach the presses as kvc's counts."""
    configs = [("h2o", {"budget": 41}), ("h2o", {"heavy": 0.2, "recent": 0.1}), ("streamingllm", {"budget": 40}),
               ("streamingllm", {"sink": 2, "budget": 40})]
    presses = [method.press(100) for method in methods_for(model_dir, configs)]
    kept = [int(100 * (1 - press.compression_ratio)) for press, _ in presses]
    assert kept == [41, 30, 40, 40]
    assert [type(press).__name__ for press, _ in presses] == ["ColumnSumPress"] * 2 + ["StreamingLLMPress"] * 2
    assert [attention for _, attention in presses] == ["eager", "eager", "sdpa", "sdpa"]
    assert (presses[0][0].recent, presses[1][0].recent) == (21, 10)
    assert (presses[2][0].n_sink, presses[3][0].n_sink) == (4, 2)


@needs_kvpress
def test_conversions_keep_counts() -> None:
    from kvpress.utils import compute_n_kept

    for length in (17, 100, 1031, 32768):
        for kept in {1, 2, length // 3, length - 1}:
            assert compute_n_kept(length, ref.ratio_keeping(length, kept)) == kept
    for budget, window in [(24, 8), (28, 16), (128, 64), (2048, 32), (9, 8)]:
        for alpha in (0, 0.01, 0.2, 0.5, 0.94, 1):
            extra = math.floor(alpha * (budget - window))
            safeguard = ref.adakv_safeguard(budget, window, alpha)
            forced = max(1, int(safeguard * budget))  # kvpress's safeguard per head, window first
            assert max(0, forced - window) == extra, (budget, window, alpha)
            if budget > window:  # and back: kvc's alpha from kvpress's forces as many
                kvc = ref.adakv_params(budget, window, 5, safeguard)
                assert math.floor(kvc["alpha"] * (budget - window)) == extra


@needs_kvpress
def test_methods_kvpress_lacks_are_config_errors(model_dir: Path) -> None:
    prompts = prompts_of(LENGTHS[:1], seed=35)
    with pytest.raises(ConfigError, match=r"no equivalent of 'quest'.*runs full, adakv, h2o"):
        ref.run_kvpress(model_dir, prompts, [("snapkv", {"budget": 8}), ("quest", {})])
    with pytest.raises(ConfigError, match="no parameter"):
        ref.run_kvpress(model_dir, prompts, [("snapkv", {"budgets": 8})])
    with pytest.raises(ConfigError, match="only average-pools"):
        ref.run_kvpress(model_dir, prompts, [("snapkv", {"budget": 32, "pooling": "max"})])
    assert set(ref.kvpress_methods()) == {"full", "snapkv", "pyramidkv", "adakv", "tova", "streamingllm", "h2o",
                                          "kvzip"}


def test_missing_kvpress_is_a_config_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "kvpress", None)  # `import kvpress` raises ImportError
    with pytest.raises(ConfigError) as error:
        ref.run_kvpress(tmp_path, prompts_of((10,), seed=0), [("full", {})])
    assert error.value.message == ("--reference kvpress needs kvpress: pip install kvpress==0.5.5 (it needs "
                                   "transformers < 5.3)")


@needs_kvpress
def test_kvzip_column_is_kvpress_alone(tmp_path: Path) -> None:
    """KVzip's column (its own prefill: the prompt, then kvpress's context reconstruction) gives the tokens
    KVzipPress gives through kvpress's standard path, beside `full` and a hooked press in the same run; a
    3-chunk replay included. The model directory has a tokenizer (the repeat prompt is text)."""
    model_dir = make_tiny_llama(tmp_path, seed=3, num_hidden_layers=4, tokenizer=True)
    configs = [("full", {}), ("kvzip", {"ratio": 0.3}), ("kvzip", {"ratio": 0.3, "chunk": 32}),
               ("snapkv", {"budget": 32, "window": 8})]
    prompts = prompts_of((90,), seed=33, max_tokens=8)
    methods = methods_for(model_dir, configs)
    model = hf_model(model_dir, "sdpa")
    shared = ref.run_on_model(model, prompts, methods, tuple(eos_of(model)))
    for i, method in enumerate(methods):
        press, attention = method.press(len(prompts[0].prompt))
        assert shared[i][0] == alone(hf_model(model_dir, attention), press, prompts[0]), configs[i]
    assert type(methods[1].press(90)[0]).__name__ == "FramedKVzipPress"
    assert shared[1] != shared[0] or shared[2] != shared[0], "KVzip changed nothing: the prompt pins too little"
