"""Serving scenarios every sparse method's tests run against its hand-written reference: a
prefix-cache hit, a chain continued and forked, a preemption recomputed as a prefill. Each takes
the served `llm`, the logits `spy` (tests/runtime/test_contract_methods.py `Logits`), `generate`
(session, prompt ids, n) -> (tokens, logits) of the reference, and `session()`, a fresh reference
session with `truncate(n)` and `copy()`. `graph_steps` runs an engine's decode-only steps through
the CUDA-graph runner's step, uncaptured (the CPU tests of the graph path)."""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from kvc.runtime.chains import ChainSpec
from tests.runtime.chained import check_books
from tests.runtime.test_contract_methods import check, greedy, prompt


def prefix_cache_hit(llm, spy, generate: Callable, session: Callable) -> None:
    first, second = prompt(30, 4), prompt(11, 5)
    a = llm.generate(first, greedy(6))[0]
    params = greedy(8)
    b = llm.generate(first[:20] + second, params)[0]
    assert b.num_cached_tokens == 20  # five full pages of 4, page summaries included
    reference = session()
    assert a.token_ids == generate(reference, first, 6)[0]
    check(b.token_ids, spy.of(params), generate(reference.truncate(20), second, 8))


def chain_continued_and_forked(llm, spy, generate: Callable, session: Callable) -> None:
    """A chain's next turn counts the stored history as its prompt (the engine's `prompt`)."""
    opening, suffixes = prompt(26, 6), [prompt(1, 7), prompt(2, 8), prompt(3, 12)]
    first = llm.generate(opening, greedy(5), chain=ChainSpec(open=True))[0]
    history = opening + first.token_ids
    reference = session()
    assert first.token_ids == generate(reference, opening, 5)[0]
    specs = [ChainSpec(fork_id=first.chain_id), ChainSpec(fork_id=first.chain_id),
             ChainSpec(continue_id=first.chain_id)]
    for user, spec in zip(suffixes, specs):
        params = greedy(6)
        out = llm.generate(history + user, params, chain=spec)[0]
        check_books(llm.engine)
        assert out.num_cached_tokens == len(history) - 1
        check(out.token_ids, spy.of(params), generate(reference.copy(), [first.token_ids[-1]] + user, 6))


def preemption_recomputes(llm, spy, generate: Callable, session: Callable, page: int, prefix_caching: bool,
                          prompt_len: int) -> None:
    """A preempted request recomputes its prompt and what it generated as one prefill, which is then
    the `prompt` the method counts (the engine's rule for every method)."""
    engine = llm.engine
    p = prompt(prompt_len, 9)
    params = greedy(9)
    seq = engine.add_request(p, params)
    for _ in range(4):  # the prefill and three decode steps: four tokens
        engine.step()
    done = len(seq.token_ids) - len(p)
    engine.scheduler._preempt(seq)
    while engine.has_unfinished():
        engine.step()
    assert seq.num_preemptions == 1
    check_books(engine)
    before = session()
    head, head_logits = generate(before, p, done)
    tokens = p + head
    if prefix_caching:  # every full page but the one holding the last token is a hit
        hit = (len(tokens) - 1) // page * page
        assert seq.num_cached_tokens == hit
        again = before.truncate(hit)
    else:
        hit, again = 0, session()
    tail, tail_logits = generate(again, tokens[hit:], 9 - done)
    check(seq.generated_ids, spy.of(params), (head + tail, torch.cat([head_logits, tail_logits])))


def graph_steps(llm, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Decode-only steps of `llm` from now on through the CUDA-graph runner's own step (its static
    buffers, batch buckets with padding rows, no host rows), run without capture on the CPU, with
    the host-reading tensor methods disarmed inside their decode hook (other steps run eagerly, as
    they do on a GPU), and so are copies of host values to the device. Returns the list that the
    batch size of every such step is appended to."""
    from kvc.runtime.decode_graphs import DecodeGraphs

    runner = llm.engine.runner
    assert llm.engine.method.decode_graphs, "the method decodes eagerly"
    graphs = runner.graphs = DecodeGraphs(runner, llm.engine.config.max_num_seqs)
    replays: list[int] = []

    def replay(batch, feed=None):
        replays.append(len(batch.seqs))
        return graphs.run_uncaptured(batch, feed)

    monkeypatch.setattr(graphs, "run", replay)
    method = llm.engine.method
    original = method.decode_before_attention

    def forbidden(*args, **kwargs):
        raise AssertionError("the decode hook read a device value on the host")

    as_tensor, new_tensor = torch.as_tensor, torch.tensor

    def from_host(make):
        def checked(data, *args, **kwargs):  # a host value copied to the device: a capture refuses it
            if not isinstance(data, torch.Tensor):
                raise AssertionError(f"the decode hook copied a host value to the device: {make.__name__}({data!r})")
            return make(data, *args, **kwargs)
        return checked

    def graph_like(layer, view):
        if view.rows is not None:  # an eager step (a prefill beside the decodes)
            return original(layer, view)
        assert view.prompt_lens is not None
        with pytest.MonkeyPatch.context() as mp:
            for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
                mp.setattr(torch.Tensor, name, forbidden)
            mp.setattr(torch, "as_tensor", from_host(as_tensor))
            mp.setattr(torch, "tensor", from_host(new_tensor))
            return original(layer, view)

    monkeypatch.setattr(method, "decode_before_attention", graph_like)
    return replays
