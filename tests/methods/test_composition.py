"""A policy composed with a storage format in one .kvm file (bench/variants/snapkv_fp8.kvm: SnapKV's
selection over FP8 storage, two `store` lines added) compiles, lowers and is served by the engine
unchanged:
- its KV spec is fp8's (half the bytes per token of the model's dtype) and its hooks SnapKV's;
- with a budget that keeps every token it gives fp8's greedy tokens and logits exactly;
- with a smaller budget it keeps SnapKV's positions, chosen on the stored (FP8-decoded) keys, and
  holds SnapKV's tokens at fp8's bytes: the memory product, which the throughput plan's largest
  batch shows (about twice SnapKV's at the same memory).

Quest reading FP8 pages (bench/variants/quest_fp8.kvm) likewise: fp8's spec plus Quest's page
summaries, kept equal to the max / min of each page's stored keys as decoded with their layer's
scale, Quest's hooks, and fp8's tokens when its budget reads every page. Quest reading KIVI storage
(bench/variants/quest_kivi.kvm): kivi's spec, its summaries of the keys as computed (a key group's codes
come when its block is full), kivi's tokens when its budget reads every page.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvc.runtime.bench.plan import model_spec, plan_batch
from kvc.runtime.config import EngineConfig
from kvc.runtime.engine import Engine
from kvc.runtime.errors import ConfigError
from kvc.runtime.llm import LLM
from kvc.runtime.methods import resolve_method
from kvc.runtime.method_api import KeepPlan
from tests.models.tiny import make_tiny_qwen3
from tests.runtime.test_contract_methods import ATOL, Logits, greedy, prompt

PAGE = 4
COMPOSED = str(Path(__file__).resolve().parents[2] / "bench" / "variants" / "snapkv_fp8.kvm")
QUEST_FP8 = str(Path(__file__).resolve().parents[2] / "bench" / "variants" / "quest_fp8.kvm")
QUEST_KIVI = str(Path(__file__).resolve().parents[2] / "bench" / "variants" / "quest_kivi.kvm")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen3(tmp_path_factory.mktemp("compose"), seed=7, num_hidden_layers=2, initializer_range=0.25)


def make_llm(model_dir: Path, method: str, params: dict | None = None, backend: str = "torch", device: str = "cpu",
             dtype: str = "bfloat16") -> LLM:
    config = EngineConfig(model=str(model_dir), device=device, dtype=dtype, page_size=PAGE, cuda_graphs=False,
                          attention_backend=backend, kv_cache_memory=2**22, method=method,
                          method_params=params or {}, max_num_batched_tokens=4096)
    return LLM.from_engine(Engine(config))


def test_the_composed_spec_is_fp8s_and_its_hooks_snapkvs(model_dir) -> None:
    composed = make_llm(model_dir, COMPOSED, {"budget": 16, "window": 4}).engine
    fp8, snapkv = make_llm(model_dir, "fp8").engine, make_llm(model_dir, "snapkv").engine
    assert composed.attention.store.spec == fp8.attention.store.spec
    assert composed.method.hooks == snapkv.method.hooks and composed.method.compacts
    spec = composed.attention.store.spec
    assert spec.bytes_per_token(2) * 2 == snapkv.attention.store.spec.bytes_per_token(2)


def test_a_budget_that_keeps_everything_is_fp8(model_dir, monkeypatch) -> None:
    spy = Logits(monkeypatch)
    prompts = [prompt(n, seed) for n, seed in ((23, 1), (30, 2))]
    want = [greedy(8) for _ in prompts]
    fp8 = [o.token_ids for o in make_llm(model_dir, "fp8").generate(prompts, want)]
    got_params = [greedy(8) for _ in prompts]
    composed = make_llm(model_dir, COMPOSED, {"budget": 64, "window": 4}).generate(prompts, got_params)
    assert [o.token_ids for o in composed] == fp8
    for a, b in zip(want, got_params):
        torch.testing.assert_close(spy.of(b), spy.of(a), atol=0, rtol=0)


def test_snapkvs_positions_on_the_stored_keys_at_fp8s_bytes(model_dir, monkeypatch) -> None:
    """The composed prefill_end keeps what SnapKV's own generated selection picks from the same
    queries and the stored (FP8-decoded) keys; its sequences hold SnapKV's token counts."""
    composed = make_llm(model_dir, COMPOSED, {"budget": 16, "window": 4})
    method = composed.engine.method
    snapkv = resolve_method("snapkv", {"budget": 16, "window": 4})
    seen = []
    original = method.prefill_end

    def spy(layer, view):
        q, keys = view.q.transpose(0, 1).clone(), view.cache.keys().clone()  # one chunk: every query
        plan = original(layer, view)
        seen.append((layer, plan, q, keys))
        return plan

    monkeypatch.setattr(method, "prefill_end", spy)
    out = composed.generate(prompt(40, 3), greedy(6))[0]
    assert len(out.token_ids) == 6 and len(seen) == 2
    for layer, plan, q, keys in seen:
        assert keys.dtype == torch.bfloat16 and keys.shape[1] == 40  # decoded from the FP8 codes
        assert isinstance(plan, KeepPlan)
        scores = snapkv.code.score(q, keys, layer=layer, num_layers=2, params=snapkv.params)
        want = snapkv.lowering.select(scores, keys.shape[1], layer=layer, num_layers=2, params=snapkv.params)
        assert [sorted(t.tolist()) for t in want] == [sorted(row.tolist()) for row in plan.indices.cpu()], layer
        assert plan.indices.shape[1] == 16


def test_the_memory_product_in_the_throughput_plan(model_dir) -> None:
    spec = model_spec(str(model_dir), torch.device("cpu"), "bfloat16")
    memory = 2**24
    plans = {name: plan_batch(resolve_method(name, {"budget": 64, "window": 4} if "snapkv" in name else None), spec,
                              memory, PAGE, 1024, 64, 10**6)
             for name in ("snapkv", COMPOSED, "fp8", "full")}
    assert plans[COMPOSED].batch >= 1.9 * plans["snapkv"].batch
    assert plans["snapkv"].batch >= 5 * plans["full"].batch and plans["fp8"].batch >= 1.9 * plans["full"].batch


def quest_params(budget: int, **extra) -> dict:
    return {"budget": budget, "page_size": PAGE, "dense_layers": 0, **extra}


def test_quest_over_fp8_is_fp8s_spec_with_quests_summaries_and_hooks(model_dir) -> None:
    composed = make_llm(model_dir, QUEST_FP8, quest_params(8)).engine
    fp8, quest = make_llm(model_dir, "fp8").engine, make_llm(model_dir, "quest", quest_params(8)).engine
    spec, fp8_spec, quest_spec = (e.attention.store.spec for e in (composed, fp8, quest))
    assert (spec.keys, spec.values) == (fp8_spec.keys, fp8_spec.values) and spec.summaries == quest_spec.summaries
    assert composed.method.hooks == quest.method.hooks
    assert spec.bytes_per_token(2) * 2 == quest_spec.bytes_per_token(2)


def test_quest_over_fp8_reading_every_page_is_fp8(model_dir) -> None:
    """A budget covering the context reads every page (fp8's greedy tokens; the logits differ only by the
    order a read plan sums in), and two pages read give other tokens (the plans are real)."""
    prompts = [prompt(n, seed) for n, seed in ((23, 1), (30, 2))]
    fp8 = [o.token_ids for o in make_llm(model_dir, "fp8").generate(prompts, [greedy(8) for _ in prompts])]
    wide = make_llm(model_dir, QUEST_FP8, quest_params(256)).generate(prompts, [greedy(8) for _ in prompts])
    assert [o.token_ids for o in wide] == fp8
    narrow = make_llm(model_dir, QUEST_FP8, quest_params(8)).generate(prompts, [greedy(8) for _ in prompts])
    assert [o.token_ids for o in narrow] != fp8


def test_quest_summaries_over_fp8_are_the_pages_stored_keys(model_dir, monkeypatch) -> None:
    """Every refresh leaves each page's kmax / kmin equal to the max / min over its stored slots of
    the FP8 codes times the page's layer's key scale (set apart per layer here, as checkpoint scales
    would be), written here from the format's definition; a budget of two pages makes the decode
    read plans real."""
    llm = make_llm(model_dir, QUEST_FP8, quest_params(8))
    store = llm.engine.attention.store
    store["k_scale"][0].fill_(0.5)
    store["k_scale"][1].fill_(0.125)
    checked = []
    refresh = store.refresh_summaries

    def spy(pages, lengths, layer=None):
        refresh(pages, lengths, layer)
        scale = store["k_scale"][layer].float()  # [Hkv, 1]
        assert bool((scale > 0).all()), layer
        for page, n in zip(pages.tolist(), lengths.tolist()):
            if n == 0:
                continue
            keys = (store["k_codes"][page, :, :n].float() * scale[:, None, :]).to(torch.bfloat16)  # [Hkv, n, D]
            torch.testing.assert_close(store["kmax"][page], keys.amax(dim=1), atol=0, rtol=0)
            torch.testing.assert_close(store["kmin"][page], keys.amin(dim=1), atol=0, rtol=0)
            checked.append(layer)

    monkeypatch.setattr(store, "refresh_summaries", spy)
    out = llm.generate([prompt(37, 4), prompt(26, 5)], [greedy(6), greedy(6)])
    assert all(len(o.token_ids) == 6 for o in out)
    assert set(checked) == {0, 1} and len(checked) > 20


def triton_equals_torch(model_dir, monkeypatch, method: str, params: dict, steps: int) -> LLM:
    """Serves two prompts with `method` on the generated Triton kernels (interpreted on a machine without a GPU)
    and checks the torch ops' tokens and logits, in float32; returns the Triton engine's LLM."""
    pytest.importorskip("triton")
    from tests.kernels.paged_cases import triton_device_and_ops

    device, _ = triton_device_and_ops("spec")
    spy = Logits(monkeypatch)
    prompts = [prompt(n, seed) for n, seed in ((29, 6), (18, 7))]
    want_params, got_params = [greedy(steps) for _ in prompts], [greedy(steps) for _ in prompts]
    want = make_llm(model_dir, method, params, dtype="float32").generate(prompts, want_params)
    llm = make_llm(model_dir, method, params, backend="triton", device=device.type, dtype="float32")
    got = llm.generate(prompts, got_params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(want_params, got_params):
        torch.testing.assert_close(spy.of(b).cpu(), spy.of(a), atol=ATOL, rtol=1e-4)
    return llm


def test_quest_over_fp8_on_the_triton_kernels(model_dir, monkeypatch) -> None:
    """The generated Triton kernels (read-plan decode over FP8 codes) give the torch ops' tokens and logits."""
    llm = triton_equals_torch(model_dir, monkeypatch, QUEST_FP8, quest_params(8), 5)
    assert llm.engine.attention.variant == "spec"


def kivi_params(budget: int) -> dict:
    return {"budget": budget, "group_size": PAGE, "residual_length": 8, "dense_layers": 0}


def test_quest_over_kivi_is_kivis_spec_with_quests_summaries_and_hooks(model_dir) -> None:
    composed = make_llm(model_dir, QUEST_KIVI, kivi_params(8)).engine
    kivi = make_llm(model_dir, "kivi", {"group_size": PAGE, "residual_length": 8}).engine
    quest = make_llm(model_dir, "quest", quest_params(8)).engine
    spec, kivi_spec, quest_spec = (e.attention.store.spec for e in (composed, kivi, quest))
    assert (spec.keys, spec.values) == (kivi_spec.keys, kivi_spec.values) and spec.summaries == quest_spec.summaries
    assert composed.method.hooks == quest.method.hooks and composed.attention.store.folds_summaries
    assert not quest.attention.store.folds_summaries


def test_quest_summaries_over_kivi_are_the_pages_keys_as_computed(model_dir, monkeypatch) -> None:
    """KIVI writes a key group's codes when its block is full, so the summaries are of the keys as computed:
    after every store, each page's kmax / kmin equal the max / min of the rows stored at its slots so far (a
    row at a page's first slot starting it over), kept here from the rows the store was given."""
    llm = make_llm(model_dir, QUEST_KIVI, kivi_params(8))
    store = llm.engine.attention.store
    rows: dict[int, list[torch.Tensor]] = {}
    checked = []
    fold = store.fold_summaries

    def spy(k, v, slots):
        fold(k, v, slots)
        for i, slot in enumerate(slots.tolist()):
            if slot < 0:
                continue
            page = slot // PAGE
            rows[page] = ([] if slot % PAGE == 0 else rows.get(page, [])) + [k[i]]
        for page in {s // PAGE for s in slots.tolist() if s >= 0}:
            keys = torch.stack(rows[page])  # [n, Hkv, D]
            torch.testing.assert_close(store["kmax"][page], keys.amax(dim=0), atol=0, rtol=0)
            torch.testing.assert_close(store["kmin"][page], keys.amin(dim=0), atol=0, rtol=0)
            checked.append(page)

    monkeypatch.setattr(store, "fold_summaries", spy)
    out = llm.generate([prompt(37, 4), prompt(26, 5)], [greedy(12), greedy(12)])
    assert all(len(o.token_ids) == 12 for o in out)
    assert len(checked) > 40


def test_quest_over_kivi_reading_every_page_is_kivi(model_dir) -> None:
    """A budget covering the context reads every page: KIVI's greedy tokens; two pages read give others."""
    prompts = [prompt(n, seed) for n, seed in ((23, 1), (30, 2))]
    kivi = make_llm(model_dir, "kivi", {"group_size": PAGE, "residual_length": 8})
    want = [o.token_ids for o in kivi.generate(prompts, [greedy(8) for _ in prompts])]
    wide = make_llm(model_dir, QUEST_KIVI, kivi_params(256)).generate(prompts, [greedy(8) for _ in prompts])
    assert [o.token_ids for o in wide] == want
    narrow = make_llm(model_dir, QUEST_KIVI, kivi_params(8)).generate(prompts, [greedy(8) for _ in prompts])
    assert [o.token_ids for o in narrow] != want


def test_quest_over_kivi_in_graph_steps(model_dir, monkeypatch) -> None:
    """Decode steps through the CUDA-graph runner's own step (static buffers, a padding row; run uncaptured
    on the CPU): the summaries fold in there too, and the tokens are the eager engine's."""
    from tests.methods import served

    prompts = [prompt(n, seed) for n, seed in ((21, 8), (34, 9), (13, 10))]
    want = make_llm(model_dir, QUEST_KIVI, kivi_params(8)).generate(prompts, [greedy(10) for _ in prompts])
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="bfloat16", page_size=PAGE, cuda_graphs=False,
                          attention_backend="torch", kv_cache_memory=2**22, method=QUEST_KIVI,
                          method_params=kivi_params(8), max_num_batched_tokens=4096, max_num_seqs=6)
    llm = LLM.from_engine(Engine(config))
    replays = served.graph_steps(llm, monkeypatch)
    got = llm.generate(prompts, [greedy(10) for _ in prompts])
    assert 3 in replays  # bucket 4: one padding row
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_quest_over_kivi_on_the_triton_kernels(model_dir, monkeypatch) -> None:
    """The generated Triton kernels (the quantizing store with its flushes, read-plan decode over KIVI's codes
    and windows) give the torch ops' tokens and logits."""
    triton_equals_torch(model_dir, monkeypatch, QUEST_KIVI, kivi_params(8), 10)


def test_a_mean_the_format_cannot_fold_is_refused_with_the_compilers_reason(model_dir, tmp_path) -> None:
    """A mean of keys written a block at a time would need each page's count: the compiler drops it, and the
    engine's refusal says why, at the .kvm line."""
    source = Path(QUEST_KIVI).read_text().replace("summary kmin = min(k, within pages)",
                                                  "summary kmin = mean(k, within pages)")
    path = tmp_path / "quest_kivi.kvm"
    path.write_text(source)
    with pytest.raises(ConfigError, match=r"quest_kivi\.kvm:\d+:1: summary kmin: k is written a block at a time"):
        make_llm(model_dir, str(path), kivi_params(64))
