"""Chains end to end through the openai client against the real engine (issue 6, acceptance):
for every served method turn 2 prefills only its suffix (`usage.prompt_tokens_details.
cached_tokens`), and a chain survives a stop string that cut turn 1 short (the server aborted
the request on the stop string; the next turn diverges from the chain's recorded tail and rolls
back). TOVA evicts at every decode step and always keeps no recent tail, so a cut behind its
newest token is refused with 409 and the reason (the issue's rule: roll back only over tokens
still held uncompressed)."""

from __future__ import annotations

import openai
import pytest

from tests.runtime.chained import METHODS, tokens
from tests.server.conftest import live_server

PROMPT = tokens(44, seed=11)
USER = tokens(9, seed=12)
STEPS = 12
ENGINE = {"model": "random:tiny", "page_size": 4, "max_model_len": 512, "kv_cache_memory": 2**24}


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _complete(client, prompt, extra, max_tokens=STEPS, **kw):
    return client.completions.create(model="kvc-test", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body={"ignore_eos": True, **extra}, **kw)


def _greedy_ids(method: str) -> tuple[list[int], object]:
    """Turn 1's greedy token ids from the offline API on the same engine settings (the server's
    text does not round-trip through the tokenizer for a random model's bytes)."""
    from kvc import LLM
    from kvc.runtime.sampling_params import SamplingParams

    llm = LLM(method=method, method_params=METHODS[method] or None, **ENGINE)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True))[0]
    return list(out.token_ids), llm


def _stop_cut(llm, generated: list[int]) -> tuple[int, str]:
    """A token index k whose token is one printable character not seen before it: a stop string
    on that character cuts the turn at token k. (The client then resends token ids: a random
    model's bytes need not survive a text round trip.)"""
    for k in range(2, len(generated)):
        head, char = llm.decode(generated[:k]), llm.decode(generated[k : k + 1])
        if len(char) == 1 and char.isprintable() and char not in head:
            return k, char
    raise AssertionError("no clean stop cut in the greedy tokens: change the prompt seed")


@pytest.mark.parametrize("method", list(METHODS))
def test_turn_two_prefills_only_its_suffix_and_survives_a_stop_string(method):
    generated, llm = _greedy_ids(method)
    cut, stop = _stop_cut(llm, generated)
    with live_server({"method": method, "method_params": METHODS[method] or None, **ENGINE}) as server:
        client = _client(server)
        first = _complete(client, PROMPT, {"chain": True})
        chain = first.model_extra["chain_id"]
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        # turn 2 resends the conversation: only the suffix (and turn 1's last, never computed
        # token) is prefilled
        second = _complete(client, PROMPT + generated + USER, {"chain_id": chain})
        assert second.model_extra["chain_id"] == chain
        history = len(PROMPT) + len(generated) - 1
        assert second.usage.prompt_tokens == history + 1 + len(USER)
        assert second.usage.prompt_tokens_details.cached_tokens == history
        assert server.metric("kvc:chains_idle") == 1

        # a stop string cuts a new chain's turn 1; the client resends the text it got
        cut_first = _complete(client, PROMPT, {"chain": True}, stop=[stop])
        assert cut_first.choices[0].finish_reason == "stop"
        assert stop not in cut_first.choices[0].text
        cut_chain = cut_first.model_extra["chain_id"]
        resent = PROMPT + generated[:cut] + USER
        if method == "tova":
            with pytest.raises(openai.ConflictError) as err:
                _complete(client, resent, {"chain_id": cut_chain})
            assert err.value.body["code"] == "chain_diverged"
            return
        cont = _complete(client, resent, {"chain_id": cut_chain})
        assert cont.usage.prompt_tokens_details.cached_tokens == len(PROMPT) + cut
        if method in ("h2o", "streamingllm"):  # decode-time eviction: the steps past the cut evicted
            return  # too, so the rolled-back chain is not the shorter turn's (only its tail is cut)
        # ... and it answers what a chain whose turn 1 ended at the cut answers
        plain = _complete(client, PROMPT, {"chain": True}, max_tokens=cut + 1)
        again = _complete(client, resent, {"chain_id": plain.model_extra["chain_id"]})
        assert cont.choices[0].text == again.choices[0].text
