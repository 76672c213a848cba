"""SkipKV served (methods/skipkv.kvm): sentence-level eviction while decoding, from the tokens' text.

The sentences are a text partition (`dim sentences = split(key, at = [...])`): the engine finds where the
tokens' text ends a span (runtime/text_spans.py), the KV spec records each slot's position, and step_end gets
each stored slot's sentence; `top` over the sentences keeps whole ones per KV head (counts differ per head).

Oracle: tests/references/skipkv.py (written from the paper, float64, loops) inside
`greedy_compressed_decode` (dense recomputation per step). On tiny random Llama and Qwen3 with kvc's
byte-level tokenizer (".\\n" is two tokens, ")\\n\\n" three), two prompts of sentences served together: the
greedy tokens and every layer's physical length after every decoding step equal the oracle's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvc.runtime.errors import ConfigError
from kvc.runtime.llm import LLM
from kvc.runtime.sampling_params import SamplingParams
from kvc.runtime.text_spans import TextSpans
from tests.models.tiny import make_tiny_llama, make_tiny_qwen3
from tests.references import skipkv
from tests.references.model_forward import greedy_compressed_decode

STEPS = 22
PAGE = 5
PARAMS = {"budget": 40, "window": 4, "kernel": 3, "every": 4}
TEXTS = [
    "The cat sat.\nIt was warm (and dry)\n\nThen it left.\nNobody saw.\n\nThe end came soon.\nA bird sang.\n",
    "One.\nTwo is more.\n\nThree (three)\n\nFour came late.\nFive.\nSix and seven.\n\nEight and nine.\nTen.\n"
    "Eleven at the door.\nTwelve.\n",
]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request, tmp_path_factory) -> Path:
    make = {"llama": make_tiny_llama, "qwen3": make_tiny_qwen3}[request.param]
    return make(tmp_path_factory.mktemp(request.param), tokenizer=True)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def test_text_spans_end_where_the_text_does(tokenizer):
    """A span ends after the token that completes a marker (markers of several tokens here); the
    index of a position counts the ends before it; a sequence scanned in steps equals one scanned at once."""
    spans = TextSpans(tokenizer, skipkv.MARKERS)
    ids = tokenizer.encode(TEXTS[0])
    pieces = [tokenizer.decode([t]) for t in ids]
    assert "".join(pieces) == TEXTS[0]
    assert "." in pieces and "\n" in pieces  # markers of two and three tokens
    ends = spans.ends(ids)
    want = skipkv.sentences(pieces + [""])
    assert [int(x) for x in spans.index(ids + [0], len(ids) + 1)] == want
    assert int(ends.sum()) == want[-1] == 7
    text_ends = [i for i in range(len(ids)) if ends[i]]
    assert all(TEXTS[0][: len("".join(pieces[: i + 1]))].endswith((".\n", ")\n\n", "\n\n")) for i in text_ends)
    for n in (3, 17, 30, len(ids)):  # incremental, one sequence
        spans.ends(ids[:n], seq_id=7)
    assert (spans.ends(ids, seq_id=7) == ends).all()
    assert (spans.ends(ids[:5] + [1, 2], seq_id=7) == spans.ends(ids[:5] + [1, 2])).all()  # another history


@pytest.mark.parametrize("threshold", [0.95, 0.2])
def test_skipkv_follows_the_reference(model_dir, tokenizer, threshold):
    """Every `every` steps each KV head keeps whole sentences (the paper's rule over the tokens it holds): the
    greedy tokens and every layer's slots (its longest head) after every step equal the oracle's; heads keep
    different counts (per-head starts); at threshold 0.2 near-duplicate sentences go first."""
    params = {**PARAMS, "threshold": threshold}
    llm = LLM(str(model_dir), method="skipkv", method_params=params, device="cpu", dtype="float32",
              page_size=PAGE, max_num_batched_tokens=64, max_prefill_chunk=32, attention_backend="torch")
    engine = llm.engine
    spec = engine.attention.store_of(0).spec
    assert spec.positions is not None and not spec.in_place and spec.head_starts
    prompts = [tokenizer.encode(text) for text in TEXTS]
    sampling = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True)
    seqs = [engine.add_request(p, sampling) for p in prompts]
    lengths = {s.seq_id: {} for s in seqs}
    per_head = set()
    while engine.has_unfinished():
        engine.step()
        for s in seqs:
            if s.is_finished or s.is_prefill or s.num_computed_tokens <= s.num_prompt_tokens:
                continue
            lengths[s.seq_id][s.num_computed_tokens - s.num_prompt_tokens] = list(s.kv_lens)
            per_head |= {tuple(starts) for starts in s.kv_starts if starts is not None}
    assert engine.pool.num_free == engine.pool.num_pages
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    piece = {}
    for seq, prompt in zip(seqs, prompts):
        want, _, want_lengths = greedy_compressed_decode(
            hf, torch.tensor(prompt), STEPS, "skipkv", **params,
            piece=lambda t: piece.setdefault(t, tokenizer.decode([t])))
        assert seq.generated_ids == want.tolist(), f"prompt of {len(prompt)} tokens"
        got = lengths[seq.seq_id]
        assert [got[step] for step in range(1, STEPS - 1)] == want_lengths[:-1]
        evicted = [want_lengths[step - 1] for step in range(PARAMS["every"], STEPS - 1, PARAMS["every"])]
        assert all(max(layer) <= len(prompt) for layer in evicted)
        assert any(max(layer) < len(prompt) for layer in evicted)  # whole sentences went
    assert any(len(set(starts)) > 1 for starts in per_head)  # KV heads kept different counts


def test_skipkv_needs_a_tokenizer(tmp_path):
    model = make_tiny_qwen3(tmp_path)  # no tokenizer in the directory
    with pytest.raises(ConfigError, match="tokenizer"):
        LLM(str(model), method="skipkv", device="cpu", dtype="float32", attention_backend="torch")


def _served(model_dir: Path, tokenizer, monkeypatch=None, graphs: bool = False, **options) -> list[list[int]]:
    llm = LLM(str(model_dir), method="skipkv", method_params={**PARAMS, "threshold": 0.2}, device="cpu",
              dtype="float32", page_size=PAGE, max_num_batched_tokens=64, max_prefill_chunk=32,
              attention_backend="torch", max_model_len=256, max_num_seqs=4, **options)
    engine = llm.engine
    if graphs:  # decode-only steps through the CUDA-graph runner's own step, uncaptured on the CPU
        from kvc.runtime.decode_graphs import DecodeGraphs

        runner = engine.runner
        runner.graphs = DecodeGraphs(runner, 4)
        monkeypatch.setattr(runner.graphs, "run", lambda batch, feed=None: runner.graphs.run_uncaptured(batch, feed))
    seqs = [engine.add_request(tokenizer.encode(text), SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
            for text, n in zip(TEXTS + [TEXTS[0][40:]], (STEPS, STEPS - 5, STEPS - 2))]
    while engine.has_unfinished():
        engine.step()
    assert engine.pool.num_free == engine.pool.num_pages
    return [s.generated_ids for s in seqs]


def test_skipkv_runs_ahead_and_in_the_graph_step(model_dir, tokenizer, monkeypatch):
    """Async scheduling (a step's spans are read while the previous step's token is still on the device: the
    spans need only the tokens before each position) and the decode graphs' step give the plain steps' tokens."""
    plain = _served(model_dir, tokenizer, async_scheduling=False)
    assert _served(model_dir, tokenizer, async_scheduling=True) == plain
    assert _served(model_dir, tokenizer, monkeypatch, graphs=True, async_scheduling=True) == plain


def test_skipkv_chained_turns(model_dir, tokenizer):
    """A chain carries the compressed KV (per-head counts and the slots' positions) into the next turn, whose
    keeps read the spans of the whole history's text; the continued turn is served from the record."""
    from kvc.runtime.chains import ChainSpec

    llm = LLM(str(model_dir), method="skipkv", method_params={**PARAMS, "threshold": 0.2}, device="cpu",
              dtype="float32", page_size=PAGE, attention_backend="torch")
    first, second = tokenizer.encode(TEXTS[1]), tokenizer.encode("Then a new line.\nAnd more.\n")
    params = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True)
    out = llm.generate(first, params, chain=ChainSpec(open=True))[0]
    record = llm.engine.chains.get(out.chain_id, None)
    assert max(record.kv_lens) < len(first) + STEPS  # compressed in turn one
    again = llm.generate(first + out.token_ids + second, params, chain=ChainSpec(continue_id=out.chain_id))[0]
    # the record holds every token fed in turn one (its last sampled token was never fed)
    assert again.num_cached_tokens == len(first) + len(out.token_ids) - 1 and len(again.token_ids) == STEPS
