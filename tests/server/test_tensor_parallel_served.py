"""`kvc serve --tensor-parallel-size 2` on the CPU: the server is unchanged for clients (the leader rank
serves, its follower replays the engine's commands); greedy completions equal one rank's."""

from __future__ import annotations

from pathlib import Path

from openai import OpenAI

from kvc import LLM, SamplingParams
from tests.models.tiny import make_tiny_qwen3
from tests.server.conftest import live_server


def test_a_two_rank_server_answers_like_one_rank(tmp_path: Path):
    model = str(make_tiny_qwen3(tmp_path, tokenizer=True))
    options = {"model": model, "dtype": "float32", "method": "snapkv", "method_params": {"budget": 24, "window": 4}}
    prompts = [[3 + (i * 11 + j * 5) % 290 for j in range(50 + 7 * i)] for i in range(4)]
    with live_server({**options, "tensor_parallel_size": 2}) as server:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        got = [client.completions.create(model="kvc-test", prompt=p, max_tokens=8, temperature=0,
                                         extra_body={"return_token_ids": True, "ignore_eos": True}).choices[0].token_ids
               for p in prompts]
        chat = client.chat.completions.create(model="kvc-test", messages=[{"role": "user", "content": "hello"}],
                                              max_tokens=4, temperature=0)
        assert chat.choices[0].message.content is not None
        server.app.state.kvc.aengine.engine.close()
    one = LLM(model, max_model_len=512, kv_cache_memory=8 * 2**20, **{k: v for k, v in options.items() if k != "model"})
    ref = one.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert got == [r.token_ids for r in ref]

