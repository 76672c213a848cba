"""Tool calls' parts without a model: the request checks, the Hermes rendering for templates that
know no tools, the grammar (checked by llguidance), and the parser over every split of a stream."""

from __future__ import annotations

import json

import llguidance
import pytest

from kvc.runtime.errors import InvalidSamplingParams
from kvc.runtime.server.tools import (
    CALL_OPEN,
    ToolStreamParser,
    parse_tool_calls,
    render_messages,
    tool_grammar,
    tool_request,
)
from kvc.runtime.structured_outputs import StructuredOutputs

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                             "parameters": CITY}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def test_tool_request_reads_choices():
    assert tool_request(None, None, None) is None
    assert tool_request([WEATHER], "none", None) is None
    assert tool_request(None, "none", None) is None
    auto = tool_request([WEATHER, TIME], None, None)
    assert auto.choice == "auto" and auto.parallel and auto.names == ["get_weather", "get_time"]
    assert tool_request([WEATHER], "required", False).parallel is False
    named = tool_request([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, None)
    assert named.choice == "get_time"
    assert named.functions[1]["parameters"] == {"type": "object", "properties": {}}


@pytest.mark.parametrize("tools, choice, param", [
    ([{"type": "retrieval"}], None, "tools.0"),
    ([{"type": "function", "function": {"description": "no name"}}], None, "tools.0.function"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], None, "tools.0.function.parameters"),
    ([WEATHER, WEATHER], None, "tools"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    ([WEATHER], "sometimes", "tool_choice"),
    (None, "required", "tool_choice"),
])
def test_bad_tools_name_the_field(tools, choice, param):
    with pytest.raises(InvalidSamplingParams) as e:
        tool_request(tools, choice, None)
    assert e.value.param == param


def test_render_messages_for_a_template_without_tools():
    request = tool_request([WEATHER], None, None)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    out = render_messages(messages, request)
    assert len(out) == 4 and out[0]["role"] == "system"
    assert out[0]["content"].startswith("Be brief.") and '"name": "get_weather"' in out[0]["content"]
    assert "<tools>" in out[0]["content"] and CALL_OPEN in out[0]["content"]
    want = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert out[2]["content"] == f"{CALL_OPEN}\n{want}\n</tool_call>"
    assert "tool_calls" not in out[2]
    assert out[3]["content"] == "<tool_response>\nsunny\n</tool_response>"
    assert messages[2]["tool_calls"] == [call]  # the request's own messages are not changed
    no_system = render_messages(messages[1:2], request)
    assert [m["role"] for m in no_system] == ["system", "user"]
    assert render_messages(messages[1:2], None) == messages[1:2]
    assert render_messages([messages[1], messages[3]], None) == [messages[1], messages[3]]  # no tools, no calls
    assert render_messages(messages[1:], None)[2]["content"].startswith("<tool_response>")


@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "get_time"}}])
@pytest.mark.parametrize("parallel", [None, False])
def test_tool_grammars_are_valid(choice, parallel):
    grammar = StructuredOutputs(grammar=tool_grammar(tool_request([WEATHER, TIME], choice, parallel))).to_grammar()
    assert llguidance.LLMatcher.validate_grammar_with_warnings(grammar)[0] is False


def test_auto_with_a_response_format_is_valid_and_text_formats_are_refused():
    request = tool_request([WEATHER], "auto", None)
    grammar = tool_grammar(request, StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "string"}}}))
    assert "answer:" in grammar
    StructuredOutputs(grammar=grammar).to_grammar()
    with pytest.raises(InvalidSamplingParams, match="only json_object and json_schema"):
        tool_grammar(request, StructuredOutputs(regex="a+"))


def test_parse_tool_calls():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == 2
    assert parse_tool_calls("plain answer") == ("plain answer", [])
    broken = f"{CALL_OPEN}not json</tool_call>"
    assert parse_tool_calls(broken) == (broken, [])  # not a call: left as content
    assert parse_tool_calls(f'{CALL_OPEN}\n{{"name": "f", "arguments": {{"a"')[1] == []  # cut off by a length limit


def test_stream_parser_equals_the_whole_parse_at_every_split():
    text = ('Sure <b>.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\nDone <tool')
    want_content, want_calls = parse_tool_calls(text)
    for size in (1, 2, 3, 5, 7, 11, len(text)):
        parser, pieces = ToolStreamParser(), []
        for at in range(0, len(text), size):
            pieces += parser.feed(text[at: at + size])
        pieces += parser.finish()
        content = "".join(p for p in pieces if isinstance(p, str))
        calls = [p for p in pieces if isinstance(p, dict)]
        assert content.strip() == want_content
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
            [(c["function"]["name"], c["function"]["arguments"]) for c in want_calls]
        assert not any(isinstance(p, str) and CALL_OPEN in p for p in pieces)  # no tag leaks into content
