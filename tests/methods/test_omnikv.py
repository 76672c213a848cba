"""OmniKV (methods/omnikv.kvm) compiled and served: its generated choice and token read plans
against the hand-written oracle (tests/references/omnikv.py, the paper's algorithm).

- The generated filter-layer choice equals the reference's; the layers after it get a token plan of
  exactly that choice plus the generated tokens, the others none.
- Decode attention over such a plan equals dense attention masked to exactly those tokens.
- With `selected = 1.0` OmniKV's greedy tokens are `full`'s (tiny Llama and Qwen3); with a small
  fraction they are not.
- Served with a small fraction it equals the reference, tokens and every sampled logit row: a batch
  with chunked prefills beside decodes, a prefix-cache hit, a chain continued and forked, a
  preemption (recomputed as a longer prefill, with and without prefix caching), the CUDA-graph step
  run uncaptured (static buffers, padding rows), and a hook that reads no host value.
"""

from __future__ import annotations

from functools import partial
import json
import math
from pathlib import Path

import pytest
import torch

from kvc.runtime.attention import torch_ops
from kvc.runtime.compiled.folder import GeneratedCode
from kvc.runtime.config import EngineConfig
from kvc.runtime.engine import Engine
from kvc.runtime.kv.plans import ReadPlan
from kvc.runtime.llm import LLM
from tests.methods import served
from tests.methods.read_spy import Plans
from tests.models.tiny import load_hf, make_tiny_llama, make_tiny_qwen3
from tests.references import omnikv as ref
from tests.runtime.chained import check_books
from tests.runtime.test_contract_methods import ATOL, Logits, check, greedy, prompt

PAGE = 4
FILTERS = [1, 3]  # of 5 layers: 0 dense, 1 chooses, 2 reads 1's choice, 3 chooses again, 4 reads 3's
SELECTED = 0.3
PARAMS = {"filters": FILTERS, "selected": SELECTED}


def lowering():
    from kvc.compiler.cache import locate
    from kvc.runtime.compiled import folder

    compiled = locate("omnikv", generated=folder.GENERATED)
    return GeneratedCode("omnikv", compiled.folder, compiled.manifest).lowering


def sym(layer: int, q: torch.Tensor, k: torch.Tensor, context: list[int], prompts: list[int]) -> dict:
    ctx = torch.tensor(context, dtype=torch.float64)
    pr = torch.tensor(prompts, dtype=torch.float64)
    return {"context": ctx, "prompt": pr, "step": ctx - pr, "layer": layer, "layers": 5, "heads": q.shape[1],
            "kv_heads": k.shape[1], "head_dim": q.shape[2]}


def batch(seed: int, context: list[int], heads: int = 6, kv_heads: int = 2, head_dim: int = 16, width: int = 40):
    """q [B, Hq, D] and keys [B, Hkv, width, D]: noise past each row's length (a page table's padding)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(len(context), heads, head_dim, generator=g)
    k = torch.randn(len(context), kv_heads, width, head_dim, generator=g) * 3
    return q, k


def test_generated_choice_and_plans_equal_the_reference() -> None:
    code = lowering()
    context, prompts = [30, 9, 40, 17], [25, 9, 31, 4]
    q, k = batch(0, context)
    for layer in range(5):
        shared: dict = {}
        if layer > 0:  # a layer past a filter layer finds that layer's choice
            code.decode_before_attention({"q": q, "k": k}, shared, sym(1, q, k, context, prompts), PARAMS)
        before = dict(shared)
        plan = code.decode_before_attention({"q": q, "k": k}, shared, sym(layer, q, k, context, prompts), PARAMS)
        if layer in FILTERS:
            assert plan is None  # a filter layer attends to everything
            for b, (n, p) in enumerate(zip(context, prompts)):
                got = shared["chosen"][b]
                want = ref.choose(q[b], k[b, :, :n], p, SELECTED)
                assert sorted(got[got >= 0].tolist()) == want.tolist()
                assert len(want) == math.floor(SELECTED * p)
            continue
        if ref.reads(layer, FILTERS) == "all":
            assert plan is None and shared == before
            continue
        tokens, last = plan
        assert tokens.shape[:2] == (len(context), k.shape[1]) and tokens.dtype == torch.int32
        assert last.tolist() == [n - p for n, p in zip(context, prompts)]
        for b in range(len(context)):
            for h in range(k.shape[1]):
                assert torch.equal(tokens[b, h], shared["chosen"][b])


def test_count_is_static_in_shape() -> None:
    """The choice's width depends on the batch's key axis only: rows' prompts and contexts change
    values, never the shape (a captured graph replays it)."""
    code = lowering()
    q, k = batch(1, [12, 12])
    shapes = set()
    for prompts in ([12, 3], [5, 12], [0, 1]):
        shared: dict = {}
        code.decode_before_attention({"q": q, "k": k}, shared, sym(1, q, k, [12, 12], prompts), PARAMS)
        shapes.add(tuple(shared["chosen"].shape))
        counts = (shared["chosen"] >= 0).sum(-1).tolist()
        assert counts == [math.floor(SELECTED * p) for p in prompts]
    assert shapes == {(2, math.floor(SELECTED * k.shape[2]))}


def test_attention_over_the_plan_is_dense_attention_masked_to_its_tokens() -> None:
    """paged_decode (the torch backend) with a generated token plan equals softmax over exactly the
    chosen prompt tokens and the generated ones, on a shuffled page table; dense differs."""
    code = lowering()
    g = torch.Generator().manual_seed(3)
    context, prompts, heads, kv_heads, head_dim = [29, 6, 17], [20, 6, 9], 4, 2, 16
    width, pool = 8, 30
    k_cache = torch.randn(pool + 1, kv_heads, PAGE, head_dim, generator=g)
    v_cache = torch.randn(pool + 1, kv_heads, PAGE, head_dim, generator=g)
    tables = torch.randperm(pool, generator=g)[:len(context) * width].view(len(context), width).int()
    keys = k_cache[tables.long()].transpose(1, 2).reshape(len(context), kv_heads, -1, head_dim)  # [B, Hkv, W, D]
    values = v_cache[tables.long()].transpose(1, 2).reshape(len(context), kv_heads, -1, head_dim)
    q = torch.randn(len(context), heads, head_dim, generator=g)
    shared: dict = {}
    code.decode_before_attention({"q": q, "k": keys}, shared, sym(1, q, keys, context, prompts), PARAMS)
    tokens, last = code.decode_before_attention({"q": q, "k": keys}, shared, sym(2, q, keys, context, prompts), PARAMS)
    lengths = torch.tensor(context, dtype=torch.int32)
    scale = 1 / math.sqrt(head_dim)
    out = torch_ops.paged_decode(q, k_cache, v_cache, tables, lengths, scale, read=ReadPlan(tokens=tokens, last=last))
    dense = torch_ops.paged_decode(q, k_cache, v_cache, tables, lengths, scale)
    group = heads // kv_heads
    for b, (n, p) in enumerate(zip(context, prompts)):
        chosen = ref.choose(q[b], keys[b, :, :n], p, SELECTED)
        seen = ref.visible(chosen, p, n)
        for h in range(heads):
            logits = (keys[b, h // group, :n] @ q[b, h]) * scale
            want = logits.masked_fill(~seen, float("-inf")).softmax(-1) @ values[b, h // group, :n]
            torch.testing.assert_close(out[b, h], want, atol=1e-6, rtol=1e-5)
    assert (out - dense).abs().max() > 1e-2, "the plan reads every token: the test is blind"


def test_layer_lists_compile_to_membership(tmp_path: Path) -> None:
    """`layer in filters` and `min(filters)` of an int[] parameter become Python over the list."""
    code = lowering()
    runs = [code.decode_before_attention_runs({"layer": layer}, {"filters": [2, 5], "selected": 0.1})
            for layer in range(8)]
    assert runs == [False, False, True, True, True, True, True, True]
    reading = [code.decode_before_attention_2_runs({"layer": layer}, {"filters": [2, 5], "selected": 0.1})
               for layer in range(8)]
    assert reading == [False, False, False, True, True, False, True, True]
    manifest = json.loads((Path(code.__file__).parent / "manifest.json").read_text())
    assert manifest["lowered"] and manifest["hooks"]["decode_before_attention"]["tokens"]
    assert not manifest["kv_spec"]["summaries"]  # the choice is made in every step: nothing stored


# ---- served ---------------------------------------------------------------------------------------


def make_llm(model_dir: Path, method: str = "omnikv", params: dict | None = None, **options) -> LLM:
    engine_options = {"max_num_batched_tokens": 4096, "device": "cpu", "attention_backend": "torch", **options}
    config = EngineConfig(model=str(model_dir), dtype="float32", page_size=PAGE, kv_cache_memory=2**22, method=method,
                          method_params=(PARAMS if params is None else params) if method == "omnikv" else {},
                          **engine_options)
    return LLM.from_engine(Engine(config))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_selecting_the_whole_prompt_is_full(tmp_path: Path, monkeypatch, arch: str) -> None:
    make = make_tiny_llama if arch == "llama" else make_tiny_qwen3
    model_dir = make(tmp_path, seed=5, num_hidden_layers=5, initializer_range=0.25)
    prompts = [prompt(n, seed) for n, seed in ((23, 1), (41, 2), (9, 3))]
    params = [greedy(12) for _ in prompts]
    full = [o.token_ids for o in make_llm(model_dir, "full").generate(prompts, params)]
    plans = Plans(monkeypatch)
    whole = make_llm(model_dir, params={"filters": FILTERS, "selected": 1.0})
    assert whole.engine.method.compacts is False  # every token stays stored: prefix caching on
    assert [o.token_ids for o in whole.generate(prompts, params)] == full
    assert plans.count > 0, "no read plan was made: the test is blind"
    few = make_llm(model_dir, params={"filters": FILTERS, "selected": 0.1})
    assert [o.token_ids for o in few.generate(prompts, params)] != full


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("omnikv"), seed=7, num_hidden_layers=5, initializer_range=0.25)


@pytest.fixture(scope="module")
def hf(model_dir: Path):
    return load_hf(model_dir)


def session() -> ref.Session:
    return ref.Session(dict(PARAMS))


def test_batch_with_chunked_prefills_equals_the_oracle(model_dir, hf, monkeypatch) -> None:
    """Requests of different lengths, prefilled in chunks of 8 beside the others' decode steps."""
    spy = Logits(monkeypatch)
    llm = make_llm(model_dir, max_num_batched_tokens=20, max_prefill_chunk=8)
    prompts = [prompt(n, seed) for n, seed in ((23, 1), (37, 2), (9, 3), (30, 4))]
    params = [greedy(10) for _ in prompts]
    outs = llm.generate(prompts, params)
    check_books(llm.engine)
    for p, out, sp in zip(prompts, outs, params):
        want = ref.generate(hf, session(), p, 10)
        check(out.token_ids, spy.of(sp), want)
        dense = ref.generate(hf, ref.Session({"filters": FILTERS, "selected": 1.0}), p, 10)[1]
        assert (dense[1:] - want[1][1:]).abs().max() > 10 * ATOL, "OmniKV changes nothing: the test is blind"


def test_the_triton_backend_equals_the_oracle(model_dir, hf, monkeypatch) -> None:
    """The generated decode kernel (variant `spec`; here under TRITON_INTERPRET=1) walks the token
    plan and then each row's generated tokens (`ReadPlan.last`): the oracle's tokens and logits."""
    pytest.importorskip("triton")
    from tests.kernels.paged_cases import triton_device_and_ops

    device, _ = triton_device_and_ops("spec")
    spy = Logits(monkeypatch)
    llm = make_llm(model_dir, device=device.type, attention_backend="triton", cuda_graphs=False)
    assert llm.engine.attention.variant == "spec"
    prompts = [prompt(n, seed) for n, seed in ((23, 1), (30, 4))]
    params = [greedy(8) for _ in prompts]
    for p, out, sp in zip(prompts, llm.generate(prompts, params), params):
        check(out.token_ids, spy.of(sp).cpu(), ref.generate(hf, session(), p, 8))


def test_keys_are_gathered_only_where_a_choice_is_made(model_dir, monkeypatch) -> None:
    """The stored keys (a copy of every row's keys) are gathered by the filter layers alone: once per
    filter layer and decode step, never by the layers that read the choice or read everything."""
    from kvc.runtime.compiled import read

    calls = []
    gather = read._stored_keys
    monkeypatch.setattr(read, "_stored_keys", lambda view: calls.append(1) or gather(view))
    llm = make_llm(model_dir)
    steps = 6
    llm.generate([prompt(20, 1)], greedy(steps))
    assert len(calls) == len(FILTERS) * (steps - 1)  # the first token comes from the prefill


def test_prefix_cache_hit(model_dir, hf, monkeypatch) -> None:
    served.prefix_cache_hit(make_llm(model_dir), Logits(monkeypatch), partial(ref.generate, hf), session)


def test_chain_continued_and_forked(model_dir, hf, monkeypatch) -> None:
    served.chain_continued_and_forked(make_llm(model_dir), Logits(monkeypatch), partial(ref.generate, hf),
                                      session)


def test_the_graph_step_run_uncaptured(model_dir, hf, monkeypatch) -> None:
    """Decode-only steps through the CUDA-graph runner's own step (static buffers, the rows' prompt
    lengths among them, batch buckets with a padding row, no host rows), run without capture on
    the CPU, with the host-reading tensor methods disarmed inside the hook: the oracle's tokens."""
    prompts = [prompt(n, seed) for n, seed in ((33, 21), (18, 22), (26, 23))]
    llm = make_llm(model_dir, max_model_len=160, max_num_seqs=6)
    replays = served.graph_steps(llm, monkeypatch)
    outs = llm.generate(prompts, [greedy(8) for _ in prompts])
    assert 3 in replays  # bucket 4: one padding row
    for p, out in zip(prompts, outs):
        assert out.token_ids == ref.generate(hf, session(), p, 8)[0]


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preemption_recomputes_as_a_prefill(model_dir, hf, monkeypatch, prefix_caching: bool) -> None:
    """A preempted request recomputes its prompt and what it generated as one prefill, which is then
    the `prompt` its choices count (the engine's rule for every method)."""
    served.preemption_recomputes(make_llm(model_dir, enable_prefix_caching=prefix_caching), Logits(monkeypatch),
                                 partial(ref.generate, hf), session, PAGE, prefix_caching, 21)


@pytest.mark.parametrize("change, reason", [
    ("selected * prompt)", None),
    ("selected * prompt, per kv_head)", "one `top(score, count)` for every head"),
])
def test_choices_the_compiler_refuses(tmp_path: Path, change: str, reason: str | None) -> None:
    """A shared choice is one set of tokens for every head of a row (the unchanged method lowers; one
    per KV head is refused with the reason). A count that falls as a row grows, which the static
    width could not bound, the checker already refuses (a negative count at long prompts)."""
    from kvc.compiler.codegen import generate
    from kvc.dsl import METHODS_DIR

    text = (METHODS_DIR / "omnikv.kvm").read_text().replace("selected * prompt)", change)
    if "per kv_head" in change:
        text = text.replace("over head, query)", "over group, query)").replace(
            "shared chosen: selection[key]", "shared chosen: selection[kv_head, key]")
    path = tmp_path / "omnikv.kvm"
    path.write_text(text)
    manifest = json.loads(generate(path)["manifest.json"])
    assert manifest["lowered"] == (reason is None), manifest.get("reason")
    if reason is not None:
        assert reason in manifest["reason"]
