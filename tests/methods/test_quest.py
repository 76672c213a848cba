"""Quest (methods/quest.kvm) compiled and served: its generated read against hand-written oracles.

- The generated page bound and page choice equal tests/references/quest.py (the paper's rule).
- Decode attention over a generated ReadPlan equals dense attention masked to exactly those pages.
- With a budget covering the context, Quest's greedy tokens are `full`'s (tiny Llama and Qwen3,
  through the real loader); with a small one they are not (the read changes something).
- With a small budget, the served method equals the hand-written page top-k oracle
  (tests/references/contract_methods.py, the same page choice), tokens and every sampled logit row:
  a batch with chunked prefills beside decodes, a prefix-cache hit, a chain continued and forked; and
  equals the contract method `PageTopK` served at matched parameters.
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
from kvc.runtime.compiled.method import CompiledMethod
from kvc.runtime.config import EngineConfig
from kvc.runtime.errors import ConfigError
from kvc.runtime.engine import Engine
from kvc.runtime.kv.plans import ReadPlan
from kvc.runtime.llm import LLM
from tests.methods import served
from tests.methods.read_spy import Plans
from tests.models.tiny import load_hf, make_tiny_llama, make_tiny_qwen3
from tests.references import quest as quest_ref
from tests.references.contract_methods import Session, generate
from tests.runtime.chained import check_books
from tests.runtime.contract_methods import PageTopK
from tests.runtime.test_contract_methods import ATOL, Logits, check, greedy, prompt

PAGE = 4
BUDGET = 12  # tokens: two ranked pages and the newest one
DENSE = 1  # the first layer reads every page


def lowering():
    from kvc.compiler.cache import locate
    from kvc.runtime.compiled import folder

    compiled = locate("quest", generated=folder.GENERATED)
    return GeneratedCode("quest", compiled.folder, compiled.manifest).lowering


def rows_of_keys(lengths: list[int], kv_heads: int, head_dim: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(kv_heads, n, head_dim, generator=g) for n in lengths]


def summaries(keys: list[torch.Tensor], width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kmax / kmin [B, Hkv, width, D] of each row's pages; columns past a row's pages hold noise
    (what a page table's padding points at)."""
    g = torch.Generator().manual_seed(seed)
    kv_heads, head_dim = keys[0].shape[0], keys[0].shape[2]
    high = torch.randn(len(keys), kv_heads, width, head_dim, generator=g) * 10
    low = high.clone()
    for b, k in enumerate(keys):
        for p in range(-(-k.shape[1] // PAGE)):
            high[b, :, p] = k[:, p * PAGE:(p + 1) * PAGE].amax(1)
            low[b, :, p] = k[:, p * PAGE:(p + 1) * PAGE].amin(1)
    return high, low


def sym(layer: int, heads: int, kv_heads: int, head_dim: int, layers: int = 4) -> dict:
    return {"context": None, "prompt": None, "step": None, "layer": layer, "layers": layers, "heads": heads,
            "kv_heads": kv_heads, "head_dim": head_dim}


def test_generated_bound_and_pages_equal_the_reference() -> None:
    code = lowering()
    lengths, heads, kv_heads, head_dim, width = [13, 4, 30, 1], 8, 2, 16, 9
    keys = rows_of_keys(lengths, kv_heads, head_dim, seed=0)
    q = torch.randn(len(lengths), heads, head_dim, generator=torch.Generator().manual_seed(1))
    kmax, kmin = summaries(keys, width, seed=2)
    inputs = {"q": q, "kmax": kmax, "kmin": kmin, "lengths": torch.tensor(lengths, dtype=torch.int32)}
    params = {"page_size": PAGE, "budget": BUDGET, "dense_layers": DENSE}
    s = sym(DENSE, heads, kv_heads, head_dim)
    scores = code.decode_before_attention_scores(inputs, {}, s, params)
    pages = code.decode_before_attention(inputs, {}, s, params)
    assert scores.shape == (len(lengths), kv_heads, width) and scores.dtype == torch.float32
    assert pages.shape == (len(lengths), kv_heads, BUDGET // PAGE) and pages.dtype == torch.int32
    for b, k in enumerate(keys):
        bounds = quest_ref.page_bounds(q[b], k, PAGE)
        torch.testing.assert_close(scores[b, :, :bounds.shape[1]], bounds, atol=1e-5, rtol=1e-5)
        want = quest_ref.read_pages(bounds, BUDGET, PAGE)
        for h in range(kv_heads):
            listed = pages[b, h].tolist()
            assert {p for p in listed if p >= 0} == want[h]
            assert listed.count(-1) == BUDGET // PAGE - len(want[h])
    assert code.decode_before_attention(inputs, {}, sym(DENSE - 1, heads, kv_heads, head_dim), params) is None


def fused_scores():
    from kvc.compiler.cache import locate
    from kvc.runtime.compiled import folder

    compiled = locate("quest", generated=folder.GENERATED)
    return GeneratedCode("quest", compiled.folder, compiled.manifest).fused("decode_before_attention")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_page_scores_equal_the_lowering_and_the_reference(dtype) -> None:
    """The generated Triton page scores (TRITON_INTERPRET on the CPU) read the store's summaries
    through scattered page tables and equal the torch lowering over the gathered summaries, and the
    hand-written bound; columns past a row's stored pages are -inf."""
    pytest.importorskip("triton")
    kernel = fused_scores()
    assert kernel is not None, "quest's read scores are fused (compiler/fusion.py, page_scores)"
    lengths, heads, kv_heads, head_dim, width, pool = [13, 4, 30, 1, 0], 6, 2, 24, 9, 60
    g = torch.Generator().manual_seed(3)
    kmax = (torch.randn(pool + 1, kv_heads, head_dim, generator=g) * 3).to(dtype)
    kmin = (kmax.float() - torch.rand(pool + 1, kv_heads, head_dim, generator=g) * 2).to(dtype)
    tables = torch.randperm(pool, generator=g)[:len(lengths) * width].view(len(lengths), width).to(torch.int32)
    q = torch.randn(len(lengths), heads, head_dim, generator=g).to(dtype)
    lens = torch.tensor(lengths, dtype=torch.int32)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs it under TRITON_INTERPRET
    out = kernel(q.to(dev), {"kmax": kmax.to(dev), "kmin": kmin.to(dev)}, tables.to(dev), lens.to(dev), PAGE,
                 block_p=4).cpu()
    assert out.shape == (len(lengths), kv_heads, width) and out.dtype == torch.float32
    gathered = {n: t[tables.long()].transpose(1, 2).float() for n, t in (("kmax", kmax), ("kmin", kmin))}
    want = lowering().decode_before_attention_scores({"q": q.float(), **gathered, "lengths": lens}, {},
                                                     sym(DENSE, heads, kv_heads, head_dim),
                                                     {"page_size": PAGE, "budget": BUDGET, "dense_layers": DENSE})
    for b, n in enumerate(lengths):
        pages = -(-n // PAGE)
        torch.testing.assert_close(out[b, :, :pages], want[b, :, :pages], atol=1e-4, rtol=1e-5)
        assert torch.isneginf(out[b, :, pages:]).all()
        for h in range(kv_heads):  # the bound by hand, page by page
            for p in range(pages):
                page = int(tables[b, p])
                bound = max(float(torch.maximum(q[b, g_].float() * kmax[page, h].float(),
                                                q[b, g_].float() * kmin[page, h].float()).sum())
                            for g_ in range(h * heads // kv_heads, (h + 1) * heads // kv_heads))
                assert abs(float(out[b, h, p]) - bound) <= 1e-4 * max(1.0, abs(bound))


def test_budgets_round_to_pages_as_quest_does() -> None:
    """`budget - page_size` tokens rank floor(. / page) pages, so budget // page pages are read in all
    (Quest's page_budget) and none is ranked below two pages; `last page_size` is the newest page; a
    row with fewer pages lists -1."""
    code = lowering()
    scores = torch.arange(10.0).repeat(1, 1, 1)  # [1, 1, 10]: later pages score higher
    lengths = torch.tensor([37])  # 10 pages, the newest partial
    cases = ((4, [9]), (7, [9]), (8, [8, 9]), (11, [8, 9]), (15, [7, 8, 9]), (16, [6, 7, 8, 9]),
             (1000, list(range(10))))
    for budget, want in cases:
        params = {"page_size": PAGE, "budget": budget, "dense_layers": 0}
        pages = code.decode_before_attention_read(scores, lengths, sym(0, 1, 1, 16), params)
        assert sorted(p for p in pages[0, 0].tolist() if p >= 0) == want, budget
    short = code.decode_before_attention_read(scores, torch.tensor([5]), sym(0, 1, 1, 16),
                                              {"page_size": PAGE, "budget": 16, "dense_layers": 0})
    assert sorted(short[0, 0].tolist()) == [-1, -1, 0, 1]


def test_attention_over_the_plan_is_dense_attention_masked_to_its_pages() -> None:
    """paged_decode (the torch backend) with the generated plan equals softmax over exactly the planned
    pages' stored slots, on a shuffled page table; the full context gives another output."""
    code = lowering()
    g = torch.Generator().manual_seed(3)
    lengths, heads, kv_heads, head_dim = [29, 6, 17], 4, 2, 16
    width, pool = 8, 30
    k_cache = torch.randn(pool + 1, kv_heads, PAGE, head_dim, generator=g)
    v_cache = torch.randn(pool + 1, kv_heads, PAGE, head_dim, generator=g)
    tables = torch.randperm(pool, generator=g)[:len(lengths) * width].view(len(lengths), width).int()
    keys = [k_cache[tables[b].long()].transpose(0, 1).reshape(kv_heads, -1, head_dim)[:, :n]
            for b, n in enumerate(lengths)]
    values = [v_cache[tables[b].long()].transpose(0, 1).reshape(kv_heads, -1, head_dim)[:, :n]
              for b, n in enumerate(lengths)]
    kmax, kmin = summaries(keys, width, seed=4)
    q = torch.randn(len(lengths), heads, head_dim, generator=g)
    context = torch.tensor(lengths, dtype=torch.int32)
    params = {"page_size": PAGE, "budget": BUDGET, "dense_layers": 0}
    pages = code.decode_before_attention({"q": q, "kmax": kmax, "kmin": kmin, "lengths": context}, {},
                                         sym(0, heads, kv_heads, head_dim), params)
    scale = 1 / math.sqrt(head_dim)
    out = torch_ops.paged_decode(q, k_cache, v_cache, tables, context, scale, read=ReadPlan(pages=pages))
    dense = torch_ops.paged_decode(q, k_cache, v_cache, tables, context, scale)
    group = heads // kv_heads
    for b, n in enumerate(lengths):
        for h in range(heads):
            listed = pages[b, h // group]
            read = (torch.arange(n)[:, None] // PAGE == listed[None, listed >= 0]).any(-1)
            logits = (keys[b][h // group] @ q[b, h]) * scale
            want = logits.masked_fill(~read, float("-inf")).softmax(-1) @ values[b][h // group]
            torch.testing.assert_close(out[b, h], want, atol=1e-6, rtol=1e-5)
    assert (out - dense).abs().max() > 1e-2, "the plan reads every page: the test is blind"


@pytest.mark.parametrize("change, reason", [
    ("budget - page_size, per kv_head", None),
    ("context - page_size, per kv_head", "may not depend on context"),
    ("budget, per head", "per head is not lowered"),
])
def test_reads_the_compiler_refuses(tmp_path: Path, change: str, reason: str | None) -> None:
    """A read plan's shape is fixed for the whole decode batch: counts reading per-row symbols are
    refused with the reason (the unchanged method lowers)."""
    from kvc.compiler.codegen import generate
    from kvc.dsl import METHODS_DIR

    text = (METHODS_DIR / "quest.kvm").read_text().replace("budget - page_size, per kv_head", change)
    if "per head" in change:
        text = text.replace("max(bound, over group)", "bound")
    path = tmp_path / "quest.kvm"
    path.write_text(text)
    manifest = json.loads(generate(path)["manifest.json"])
    assert manifest["lowered"] == (reason is None), manifest.get("reason")
    if reason is not None:
        assert reason in manifest["reason"]


# ---- served ---------------------------------------------------------------------------------------


def make_llm(model_dir: Path, method: str = "quest", **options) -> LLM:
    params = options.pop("method_params", {"page_size": PAGE, "budget": BUDGET, "dense_layers": DENSE})
    engine_options = {"max_num_batched_tokens": 4096, **options}
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", page_size=PAGE,
                          attention_backend="torch", kv_cache_memory=2**22, method=method,
                          method_params=params if method == "quest" else {}, **engine_options)
    return LLM.from_engine(Engine(config))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_budget_covering_the_context_is_full(tmp_path: Path, monkeypatch, arch: str) -> None:
    make = make_tiny_llama if arch == "llama" else make_tiny_qwen3
    model_dir = make(tmp_path, seed=5, num_hidden_layers=3, initializer_range=0.25)
    prompts = [prompt(n, seed) for n, seed in ((23, 1), (41, 2), (9, 3))]
    params = [greedy(12) for _ in prompts]
    full = [o.token_ids for o in make_llm(model_dir, "full").generate(prompts, params)]
    plans = Plans(monkeypatch)
    wide = make_llm(model_dir, method_params={"page_size": PAGE, "budget": 4096, "dense_layers": DENSE})
    assert wide.engine.method.compacts is False  # every token stays stored: prefix caching on
    assert [o.token_ids for o in wide.generate(prompts, params)] == full
    assert plans.count > 0, "no read plan was made: the test is blind"
    narrow = make_llm(model_dir, method_params={"page_size": PAGE, "budget": 2 * PAGE, "dense_layers": DENSE})
    assert [o.token_ids for o in narrow.generate(prompts, params)] != full


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("quest"), seed=7, num_hidden_layers=3, initializer_range=0.25)


@pytest.fixture(scope="module")
def hf(model_dir: Path):
    return load_hf(model_dir)


def session() -> Session:
    return Session("pagetopk", {"page_size": PAGE, "pages": BUDGET // PAGE, "dense_layers": DENSE})


def test_batch_with_chunked_prefills_equals_the_oracle(model_dir, hf, monkeypatch) -> None:
    """Requests of different lengths, prefilled in chunks of 8 beside the others' decode steps."""
    spy = Logits(monkeypatch)
    llm = make_llm(model_dir, max_num_batched_tokens=20, max_prefill_chunk=8)
    prompts = [prompt(n, seed) for n, seed in ((23, 1), (37, 2), (9, 3), (30, 4))]
    params = [greedy(10) for _ in prompts]
    outs = llm.generate(prompts, params)
    check_books(llm.engine)
    for p, out, sp in zip(prompts, outs, params):
        want = generate(hf, session(), p, 10)
        check(out.token_ids, spy.of(sp), want)
        _, dense = generate(hf, Session("full", {}), p, 10)
        assert (dense[1:] - want[1][1:]).abs().max() > 10 * ATOL, "Quest changes nothing: the test is blind"


def test_prefix_cache_hit(model_dir, hf, monkeypatch) -> None:
    served.prefix_cache_hit(make_llm(model_dir), Logits(monkeypatch), partial(generate, hf), session)


def test_chain_continued_and_forked(model_dir, hf, monkeypatch) -> None:
    served.chain_continued_and_forked(make_llm(model_dir), Logits(monkeypatch), partial(generate, hf),
                                      session)


def test_equals_the_contract_page_top_k(model_dir, monkeypatch) -> None:
    """The compiled Quest and the hand-written contract method choose the same pages at matched
    parameters (every layer sparse): the same tokens and logits."""
    spy = Logits(monkeypatch)
    prompts = [prompt(n, seed) for n, seed in ((23, 1), (37, 2))]
    quest = make_llm(model_dir, method_params={"page_size": PAGE, "budget": BUDGET, "dense_layers": 0})
    assert isinstance(quest.engine.method, CompiledMethod)
    q_params = [greedy(10) for _ in prompts]
    q_out = quest.generate(prompts, q_params)
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", page_size=PAGE,
                          attention_backend="torch", max_num_batched_tokens=4096, kv_cache_memory=2**22)
    contract = LLM.from_engine(Engine(config, method=PageTopK(pages=BUDGET // PAGE)))
    c_params = [greedy(10) for _ in prompts]
    c_out = contract.generate(prompts, c_params)
    for a, b, pa, pb in zip(q_out, c_out, q_params, c_params):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(spy.of(pa), spy.of(pb), atol=1e-5, rtol=1e-5)


def _page_flags(source: str) -> dict:
    from kvc.compiler import fusion, ir
    from kvc.dsl import check_source

    method = ir.build(check_source(source, "bound.kvm"), source.encode())
    (kernel,) = [k for k in fusion.plan(method).kernels if k.family == "page_scores"]
    return dict(kernel.flags)


BOUND_KVM = """method bound : sparse
param budget: tokens = 64 in [1, 4096]
dim pages = split(key, size = 16)
summary hi = {hi}(k, within pages)
summary lo = {lo}(k, within pages)
on decode_before_attention:
  bound = sum(max(q * {a}, {b} * q), over channel)
  read top(max(bound, over group), budget, per kv_head)
"""


def test_bound_rewrite_needs_a_max_and_a_min_summary_of_one_source() -> None:
    """The page-score kernel multiplies `max(q, 0) . hi + min(q, 0) . lo` only where hi >= lo is
    known: hi a max and lo a min of the same source over the same pages (either order in the
    expression); a max of k against a min of v, or two maxima, keep the elementwise form."""
    from kvc.runtime.compiled import folder

    shipped_manifest = json.loads((folder.GENERATED / "quest" / "manifest.json").read_text())
    (shipped,) = [k for k in shipped_manifest["kernels"] if k["family"] == "page_scores"]
    assert shipped["flags"]["BOUND"] == ["kmax", "kmin"]
    assert _page_flags(BOUND_KVM.format(hi="max", lo="min", a="hi", b="lo"))["BOUND"] == ("hi", "lo")
    assert _page_flags(BOUND_KVM.format(hi="min", lo="max", a="hi", b="lo"))["BOUND"] == ("lo", "hi")
    assert _page_flags(BOUND_KVM.format(hi="max", lo="max", a="hi", b="lo"))["BOUND"] == ()
    mixed = BOUND_KVM.format(hi="max", lo="min", a="hi", b="lo").replace("lo = min(k", "lo = min(v")
    assert _page_flags(mixed)["BOUND"] == ()


def test_the_engine_takes_the_methods_page_when_none_is_set(model_dir) -> None:
    """An engine started without a page size takes the page Quest summarises (`--method-param
    page_size=4` alone is enough); a method without page summaries gets the default; a page size
    set on the engine that differs from the method's is refused, naming both."""
    common = dict(model=str(model_dir), device="cpu", dtype="float32", attention_backend="torch",
                  kv_cache_memory=2**22)
    for page in (4, 8):
        engine = Engine(EngineConfig(method="quest", method_params={"page_size": page}, **common))
        assert engine.config.page_size == page and engine.pool.page_size == page
    assert Engine(EngineConfig(method="snapkv", **common)).config.page_size == 16
    with pytest.raises(ConfigError, match=r"pages of 4 tokens \(its page summaries or page scales\); the "
                                          "engine's pages hold 16"):
        Engine(EngineConfig(method="quest", method_params={"page_size": 4}, page_size=16, **common))
