"""64 concurrent streaming clients, a third of them hanging up early: the others get exactly
their greedy outputs, and every page the leavers held goes back (/metrics shows the idle count)."""

from __future__ import annotations

import asyncio

from openai import AsyncOpenAI

from kvc import SamplingParams
from tests.server.conftest import live_server

NUM_CLIENTS = 64
MAX_TOKENS = 12
LEAVER_TOKENS = 4000  # tens of seconds of work if the leavers' requests were not aborted


def test_64_streaming_clients_with_a_third_disconnecting(llm):
    with live_server({"max_model_len": 4096, "kv_cache_memory": 64 * 2**20}) as server:
        _run_clients(server, llm)


def _run_clients(server, llm):
    idle = server.metric("kvc:kv_pages_used")
    prompts = [f"client {i}: tell me about {i * 7}" for i in range(NUM_CLIENTS)]
    leaves = [i % 3 == 0 for i in range(NUM_CLIENTS)]
    refs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)

    async def one(i: int):
        leaver = leaves[i]
        # leavers ask for many tokens so that they are surely mid-stream when they hang up
        stream = await client.completions.create(
            model="kvc-test", prompt=prompts[i], temperature=0, stream=True,
            max_tokens=LEAVER_TOKENS if leaver else MAX_TOKENS, extra_body={"ignore_eos": leaver},
        )
        text, reason, chunks = "", None, 0
        async for chunk in stream:
            chunks += 1
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
            if leaver and chunks == 3:
                await stream.close()
                return None
        return text, reason

    async def main():
        results = await asyncio.gather(*(one(i) for i in range(NUM_CLIENTS)))
        await client.close()
        return results

    results = asyncio.run(main())
    for i, (ref, got) in enumerate(zip(refs, results)):
        if leaves[i]:
            assert got is None
        else:
            assert got == (ref.text, ref.finish_reason), i
    # aborted at once, not left to run out their thousands of tokens
    assert server.wait_metric("kvc:kv_pages_used", idle, timeout=3) == idle
    assert server.wait_metric("kvc:num_requests_running", 0, timeout=1) == 0
    assert server.metric("kvc:num_requests_waiting") == 0
    assert not server.state.aengine.active
