"""Structured outputs in the engine (runtime/structured_outputs.py, runtime/grammar_book.py): every
kind of constraint holds on the embedded default model, greedy and sampled, beside unconstrained rows
that it leaves untouched; the bit masks unpack to the right tokens; bad grammars and models without a
tokenizer are clear errors before any work starts."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from kvc import LLM, SamplingParams, StructuredOutputs
from kvc.runtime.errors import InvalidSamplingParams
from kvc.runtime.grammar_book import GrammarBook, unpack_bits
from kvc.runtime.scheduler import Scheduler, ScheduledBatch
from kvc.runtime.sequence import Sequence

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(real_model_dir):
    return LLM(str(real_model_dir), max_model_len=1024, kv_cache_memory=2**27, dtype="float32")


def chat(llm, text: str) -> list[int]:
    rendered = llm.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=False)
    return llm.tokenizer.encode(rendered, add_special_tokens=False)


@pytest.mark.real_model
def test_each_kind_of_constraint_holds(llm):
    prompt = chat(llm, "Describe a person named Alice who is 30 years old, as JSON.")
    cases = [(StructuredOutputs(json=PERSON), lambda t: jsonschema.validate(json.loads(t), PERSON)),
             (StructuredOutputs(json=json.dumps(PERSON)), lambda t: jsonschema.validate(json.loads(t), PERSON)),
             (StructuredOutputs(choice=["yes", "no"]), lambda t: t in ("yes", "no") or 1 / 0),
             (StructuredOutputs(regex=r"[0-9]{3}-[0-9]{4}"), lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t) or 1 / 0),
             (StructuredOutputs(grammar='start: "A" ("b" | "c")+ "!"'),
              lambda t: re.fullmatch(r"A[bc]+!", t) or 1 / 0)]
    params = [SamplingParams(max_tokens=200, temperature=0, structured_outputs=so) for so, _ in cases]
    outs = llm.generate([prompt] * len(cases), params)
    for (so, check), out in zip(cases, outs):
        assert out.finish_reason == "stop", (so, out.text)
        check(out.text)
    assert json.loads(outs[0].text)["name"] == "Alice"


@pytest.mark.real_model
def test_sampled_rows_hold_and_free_rows_are_untouched(llm):
    prompt = chat(llm, "Write a phone number.")
    free = SamplingParams(max_tokens=12, temperature=0)
    alone = llm.generate([prompt], free)[0].token_ids
    constrained = SamplingParams(max_tokens=30, temperature=1.0, seed=3,
                                 structured_outputs=StructuredOutputs(regex=r"\+33 [1-9]( [0-9]{2}){4}"))
    outs = llm.generate([prompt] * 4, [constrained, free, constrained, constrained])
    assert outs[1].token_ids == alone
    for out in (outs[0], outs[2], outs[3]):
        assert re.fullmatch(r"\+33 [1-9]( [0-9]{2}){4}", out.text), out.text
    assert not llm.engine.grammars.matchers  # released with their sequences


def test_bit_masks_unpack_to_tokens():
    g = torch.Generator().manual_seed(0)
    allowed = torch.rand(3, 70, generator=g) < 0.3
    words = torch.zeros(3, 3, dtype=torch.int64)
    for r, t in allowed.nonzero().tolist():
        words[r, t // 32] |= 1 << (t % 32)
    bits = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the bit pattern as int32
    assert torch.equal(unpack_bits(bits, 70), allowed)


@pytest.mark.parametrize("fields, match", [
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["b"]}, "exactly one"),
    ({"choice": []}, "non-empty list"),
    ({"choice": "ab"}, "non-empty list"),
])
def test_structured_outputs_fields_are_checked(fields, match):
    with pytest.raises(InvalidSamplingParams, match=match):
        StructuredOutputs(**fields)


@pytest.mark.parametrize("so, match", [
    (StructuredOutputs(json="{not json"), "not valid JSON"),
    (StructuredOutputs(json={"type": "bogus"}), "rejected"),
    (StructuredOutputs(regex="[a-"), "rejected"),
    (StructuredOutputs(grammar="start: missing_rule"), "rejected"),
])
def test_bad_grammars_are_refused_up_front(so, match):
    with pytest.raises(InvalidSamplingParams, match=match) as e:
        so.to_grammar()
    assert e.value.param == "structured_outputs"


def test_random_weights_follow_the_grammar_alone():
    """The random tiny model's tokens are noise: only the masks make them valid, sampled or greedy."""
    llm = LLM("random:tiny", kv_cache_memory=2**22, dtype="float32")
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"enum": ["x", "y"]}},
              "required": ["a", "b"], "additionalProperties": False}
    for seed in range(3):
        outs = llm.generate([[5, 6, 7], [8, 9]], [
            SamplingParams(max_tokens=40, temperature=1.0, seed=seed,
                           structured_outputs=StructuredOutputs(regex="[0-9]{3}-[a-z]{2}")),
            SamplingParams(max_tokens=40, temperature=0 if seed else 1.0, seed=seed,
                           structured_outputs=StructuredOutputs(json=schema))])
        assert re.fullmatch("[0-9]{3}-[a-z]{2}", outs[0].text) and outs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(outs[1].text), schema)
    free = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=1.0, seed=0))[0].text
    assert not re.fullmatch("[0-9]{3}-[a-z]{2}", free)  # without the mask, noise


def test_a_model_without_tokenizer_refuses_structured_outputs():
    book = GrammarBook(None, 301, (0,))
    with pytest.raises(InvalidSamplingParams, match="no \\(fast\\) tokenizer"):
        book.matcher(StructuredOutputs(regex="a").to_grammar())


def test_constrained_steps_are_not_scheduled_ahead():
    plain = Sequence([1, 2], params=SamplingParams(max_tokens=4), max_model_len=64)
    constrained = Sequence([1, 2], params=SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(regex="a")),
                           max_model_len=64)
    assert Scheduler.may_run_ahead(ScheduledBatch(seqs=[plain], num_new_tokens=[1], num_decodes=1))
    assert not Scheduler.may_run_ahead(ScheduledBatch(seqs=[plain, constrained], num_new_tokens=[1, 1],
                                                      num_decodes=2))
