"""Tool calls and structured outputs served with the embedded default model (SmolLM2-135M-Instruct,
greedy), through the openai client: a required or named call parsed into `tool_calls` (whole and
streamed), the result in the history answered, JSON that validates against the request's schema,
and the clear 400s. The model's template knows no tools, so kvc writes them in the Hermes format."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai import OpenAI

from tests.server.conftest import live_server

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                   "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    with live_server(engine_options={"model": None, "max_model_len": 2048, "kv_cache_memory": 2**28},
                     served_model_name=MODEL) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def _valid_call(call, tool: dict) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == tool["function"]["name"]
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


def test_required_call_is_parsed(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                       parallel_tool_calls=False, temperature=0, max_tokens=60)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    assert _valid_call(choice.message.tool_calls[0], WEATHER) == {"city": "Paris"}


def test_named_function_is_forced(client):
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert _valid_call(calls[0], TIME)["zone"] in ("UTC", "CET")  # the enum holds, whatever the model wanted


def test_streamed_calls_equal_the_whole_response(client):
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                  temperature=0, max_tokens=60)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    deltas, reasons, content = [], [], ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            deltas += c.delta.tool_calls or []
            content += c.delta.content or ""
            reasons.append(c.finish_reason)
    assert content == "" and reasons[-1] == "tool_calls"
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == \
        [(0, c.function.name, c.function.arguments) for c in whole]
    assert deltas[0].id.startswith("call_")


def test_the_tool_result_is_answered(client):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=60)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 23 degrees Celsius"}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], temperature=0, max_tokens=60)
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert "23" in r.choices[0].message.content


def test_json_schema_response_format(client):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
              "required": ["city", "country"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=80, messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_json_object_response_format(client):
    r = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=120, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Give the capital of France as a JSON object."}])
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    assert r.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools.0.function"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "structured_outputs"),
    ({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": 1}, "parallel_tool_calls"),
])
def test_bad_tool_and_format_requests_are_400(server, body, param):
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={"messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
