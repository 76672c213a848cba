"""SnapKV through chains == the hand-written session reference (tests/references/chain_snapkv.py):
turn 1 compressed, turn 2 appended on the compressed state and compressed again, and so on.

Greedy tokens of every turn must be equal. Tiny Llama (GQA 4) and Qwen3 (GQA 2, q/k norms), 2
layers, pages of 4 tokens (no prompt fills its last page), each prefill in one step or in chunks
of 5 tokens (chunks split the 6-query observation window of a continued turn).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvc.runtime.chains import ChainSpec
from tests.models.tiny import load_hf, make_tiny_llama, make_tiny_qwen3
from tests.references.chain_snapkv import snapkv_session
from tests.runtime.chained import check_books, make_llm, tokens, turn

PARAMS = {"budget": 20, "window": 6, "kernel": 3}
STEPS = [6, 5, 4]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    make = make_tiny_llama if request.param == "llama" else make_tiny_qwen3
    return make(tmp_path_factory.mktemp("chain-snapkv"), seed=5, num_hidden_layers=2)


@pytest.mark.parametrize("chunk", [None, 5])
def test_snapkv_chain_matches_the_session_reference(model_dir: Path, chunk: int | None) -> None:
    options = {"max_num_batched_tokens": 16, "max_prefill_chunk": chunk} if chunk else {}
    llm = make_llm(model_dir, "snapkv", PARAMS, **options)
    conversation, spec = tokens(41, seed=7), ChainSpec(open=True)
    prompts, served = [], []
    for k, steps in enumerate(STEPS):
        prompts.append(conversation)
        out = turn(llm, conversation, steps, spec)
        served.append(out.token_ids)
        if k:
            assert out.num_cached_tokens == len(prompts[-2]) + STEPS[k - 1] - 1
        spec = ChainSpec(continue_id=out.chain_id)
        conversation = conversation + out.token_ids + tokens(13 + k, seed=20 + k)
    check_books(llm.engine)
    expected = snapkv_session(load_hf(model_dir), prompts, STEPS, **{**PARAMS, "pool": "avg"})
    assert served == expected
