"""Third-party agent frameworks against `kvc serve` with the embedded default model (greedy), as
their users write them, with no kvc-specific option:
- the openai-agents SDK: an agent with a function tool calls it, the SDK runs it, and the agent
  answers with its result; four runs of one conversation on SnapKV with `--auto-chain` each reuse
  at least 90% of the previous request's prompt (`cached_tokens`, which the SDK reports);
- LangChain: `with_structured_output` returns an object that validates against its schema, and
  `bind_tools` gets a parsed tool call."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import BaseModel

from tests.server.conftest import live_server

agents = pytest.importorskip("agents")
langchain_openai = pytest.importorskip("langchain_openai")

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"
ENGINE = {"model": None, "max_model_len": 2048, "kv_cache_memory": 2**28}
SNAPKV = {**ENGINE, "method": "snapkv", "method_params": {"budget": 128, "window": 8, "kernel": 5}}


def weather_agent(url: str, calls: list[str]):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no export to OpenAI's tracing service

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return "Sunny, 23 degrees Celsius"

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    return Agent(name="weather", instructions="You answer questions about the weather.", tools=[get_weather],
                 model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
                 model_settings=ModelSettings(temperature=0, max_tokens=60, tool_choice="get_weather"))


def test_openai_agents_tool_call_and_answer():
    from agents import Runner

    calls: list[str] = []
    with live_server(engine_options=ENGINE, served_model_name=MODEL) as s:
        result = asyncio.run(Runner.run(weather_agent(s.url, calls), "What is the weather in Paris?", max_turns=4))
    assert calls == ["Paris"]  # the model's call, executed by the SDK
    assert "23" in result.final_output and "sunny" in result.final_output.lower()


def test_openai_agents_four_runs_reuse_the_chain():
    """Each run: the call (forced by name), the SDK's tool result, the answer; the conversation
    grows by the SDK's own history (`to_input_list`). No extra_body: --auto-chain finds the chain."""
    from agents import Runner

    calls: list[str] = []
    questions = ["What is the weather in Paris?", "And in Lyon?", "What about Nice?", "And Marseille?"]
    usages = []

    async def conversation(agent) -> None:
        history: list = []
        for question in questions:
            result = await Runner.run(agent, history + [{"role": "user", "content": question}], max_turns=4)
            usages.extend((r.usage.input_tokens, r.usage.input_tokens_details.cached_tokens)
                          for r in result.raw_responses)
            history = result.to_input_list()

    with live_server(engine_options=SNAPKV, served_model_name=MODEL, auto_chain_min_tokens=32) as s:
        asyncio.run(conversation(weather_agent(s.url, calls)))
    assert len(calls) == 4 and len(usages) == 8
    for (previous_prompt, _), (prompt, cached) in zip(usages, usages[1:]):
        assert prompt > previous_prompt
        assert cached >= 0.9 * previous_prompt, usages


class City(BaseModel):
    city: str
    country: str


def test_langchain_structured_output_and_tools():
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return "Sunny"

    with live_server(engine_options=ENGINE, served_model_name=MODEL) as s:
        chat = langchain_openai.ChatOpenAI(base_url=f"{s.url}/v1", api_key="unused", model=MODEL, temperature=0,
                                           max_tokens=60, max_retries=0)
        place = chat.with_structured_output(City).invoke("Name the capital of France and its country.")
        assert isinstance(place, City) and place.city and place.country
        message = chat.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Paris?")
    assert [c["name"] for c in message.tool_calls] == ["get_weather"]
    assert message.tool_calls[0]["args"] == {"city": "Paris"}
