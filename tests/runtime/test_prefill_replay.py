"""Prefill records (runtime/prefill_record.py): a prompt prefilled once by `full` and replayed into an
engine of another method gives exactly the tokens that engine computes by running the model itself,
for every served method, chunked prefills and chains included; replayed steps run no model layer;
bad records are clear errors. Both engines schedule prefills first, so they batch alike."""

from __future__ import annotations

import pytest
import torch

from kvc import LLM, SamplingParams
from kvc.runtime.chains import ChainSpec
from kvc.runtime.errors import ConfigError, InvalidPromptError
from kvc.runtime.prefill_record import PrefillRecord
from tests.models.tiny import make_tiny_llama

METHODS = {
    "full": {},
    "snapkv": {"budget": 24, "window": 8},
    "pyramidkv": {"budget": 24, "window": 8},
    "adakv": {"budget": 24, "window": 8},
    "tova": {"budget": 24},
    "h2o": {"budget": 24},
    "streamingllm": {"budget": 24},
    "quest": {"budget": 16, "page_size": 8, "dense_layers": 1},
}
OPTIONS = dict(device="cpu", dtype="float32", page_size=8, max_num_batched_tokens=48, prefill_first=True,
               enable_prefix_caching=False, kv_cache_memory=2**23, max_model_len=512)
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("llama"), seed=4, num_hidden_layers=3)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(8)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in (61, 97, 130)]


@pytest.fixture(scope="module")
def recorded(model_dir, prompts):
    records = [PrefillRecord() for _ in prompts]
    outs = LLM(str(model_dir), **OPTIONS).generate(prompts, GREEDY, record=records)
    assert all(r.complete and list(r.tokens) == p for r, p in zip(records, prompts))
    return records, [o.token_ids for o in outs]


@pytest.mark.parametrize("method", sorted(METHODS))
def test_replay_equals_the_method_running_the_model(model_dir, prompts, recorded, method, monkeypatch) -> None:
    records, full_tokens = recorded
    direct = LLM(str(model_dir), method=method, method_params=METHODS[method] or None, **OPTIONS)
    want = [o.token_ids for o in direct.generate(prompts, GREEDY)]
    llm = LLM(str(model_dir), method=method, method_params=METHODS[method] or None, **OPTIONS)
    widths: list[int] = []
    forward = llm.engine.model.forward
    monkeypatch.setattr(llm.engine.model, "forward", lambda ids, *a: widths.append(len(ids)) or forward(ids, *a))
    got = [o.token_ids for o in llm.generate(prompts, GREEDY, replay=records)]
    assert got == want, method
    assert max(widths) <= len(prompts), "a prefill chunk ran the model instead of its record"
    if method == "full":
        assert got == full_tokens
    else:
        assert got != full_tokens, f"{method} at this budget should change some answer"


def test_a_chain_opened_from_a_replay_continues(model_dir, prompts, recorded) -> None:
    records, _ = recorded
    results = []
    for replay in (None, records[2]):
        llm = LLM(str(model_dir), method="snapkv", method_params=METHODS["snapkv"], **OPTIONS)
        first = llm.generate(prompts[2], GREEDY, chain=ChainSpec(open=True),
                             replay=None if replay is None else [replay])[0]
        turn = prompts[2] + first.token_ids + [11, 12, 13, 14]
        second = llm.generate(turn, GREEDY, chain=ChainSpec(continue_id=first.chain_id))[0]
        assert second.num_cached_tokens >= len(prompts[2])
        results.append((first.token_ids, second.token_ids))
    assert results[0] == results[1]


def test_bad_records_are_clear_errors(model_dir, prompts, recorded) -> None:
    records, _ = recorded
    llm = LLM(str(model_dir), method="snapkv", method_params=METHODS["snapkv"], **OPTIONS)
    with pytest.raises(InvalidPromptError, match="another prompt"):
        llm.generate(prompts[0][:-1], GREEDY, replay=[records[0]])
    with pytest.raises(InvalidPromptError, match="incomplete"):
        llm.generate(prompts[0], GREEDY, replay=[PrefillRecord()])
    first = llm.generate(prompts[1], GREEDY, chain=ChainSpec(open=True))[0]
    with pytest.raises(ConfigError, match="continuation"):
        llm.generate(prompts[1] + first.token_ids, GREEDY, chain=ChainSpec(continue_id=first.chain_id),
                     replay=[PrefillRecord(tokens=tuple(prompts[1] + first.token_ids))])


def test_a_prefix_cache_hit_leaves_the_record_incomplete(model_dir, prompts) -> None:
    llm = LLM(str(model_dir), **{**OPTIONS, "enable_prefix_caching": True})
    llm.generate(prompts[2], GREEDY)  # its pages are cached now
    record = PrefillRecord()
    llm.generate(prompts[2], GREEDY, record=[record])
    assert record.invalid and not record.complete


def test_prefill_first_runs_no_decode_beside_a_prefill(model_dir, prompts) -> None:
    llm = LLM(str(model_dir), **OPTIONS)
    engine, mixed = llm.engine, []
    schedule = engine.scheduler.schedule

    def spy():
        batch = schedule()
        if batch is not None and 0 < batch.num_decodes < len(batch.seqs):
            mixed.append(batch.num_decodes)
        return batch

    engine.scheduler.schedule = spy
    llm.generate(prompts, GREEDY)
    assert not mixed
    engine.scheduler.schedule = schedule
    default = LLM(str(model_dir), **{**OPTIONS, "prefill_first": False})
    mixed.clear()
    engine, schedule = default.engine, default.engine.scheduler.schedule
    engine.scheduler.schedule = spy
    default.generate(prompts, GREEDY)
    assert mixed, "without prefill_first the default scheduler mixes decodes into prefill steps"


def test_a_chunk_state_no_budget_shapes_is_computed_once_per_record(model_dir, prompts, recorded,
                                                                      monkeypatch) -> None:
    """H2O's prefill column sums read no parameter: the engines of every budget replaying one record
    compute them once (the record's memo) and still give the tokens each computes alone."""
    from kvc.runtime.compiled.method import CompiledMethod

    records = [PrefillRecord() for _ in prompts]  # fresh records: an empty memo
    LLM(str(model_dir), **OPTIONS).generate(prompts, GREEDY, record=records)
    calls: list[int] = []
    blocks = CompiledMethod._chunk_in_blocks
    monkeypatch.setattr(CompiledMethod, "_chunk_in_blocks", lambda self, *a: calls.append(1) or blocks(self, *a))
    for budget in (16, 24, 40):
        params = {"budget": budget}
        want = [o.token_ids for o in LLM(str(model_dir), method="h2o", method_params=params, **OPTIONS)
                .generate(prompts, GREEDY)]
        before = len(calls)
        got = [o.token_ids for o in LLM(str(model_dir), method="h2o", method_params=params, **OPTIONS)
               .generate(prompts, GREEDY, replay=records)]
        assert got == want, budget
        replayed = len(calls) - before
        assert replayed > 0 if budget == 16 else replayed == 0, (budget, replayed)
