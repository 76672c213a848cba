"""Tool calls in chat completions, in the Hermes format (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
which the Qwen3 and SmolLM2 families use).

Three parts (docs/serving.md, "Tool calls"):
- the prompt: a chat template that renders `tools` itself gets them; one that ignores them (the
  embedded SmolLM2's) gets them in a system message, with earlier calls and results written in the
  same format (`render_messages`);
- the grammar (`tool_grammar`): `required` or a named function forces one call (or several, with
  parallel_tool_calls) whose JSON matches the function's schema; `auto` leaves text free but forces
  valid calls once the model opens `<tool_call>` (an llguidance lazy trigger);
- the parser: the output's `<tool_call>` blocks become `message.tool_calls` (`parse_tool_calls`),
  and in a stream, content deltas stop at a tag and each call arrives whole (`ToolStreamParser`).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from kvc.runtime.errors import InvalidSamplingParams
from kvc.runtime.structured_outputs import StructuredOutputs, answer_lark, json_schema_lark

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolRequest:
    """A request's function tools and how it wants them used."""

    functions: tuple[dict[str, Any], ...]  # {"name", "description"?, "parameters"}
    choice: str  # "auto", "required", or a function's name
    parallel: bool = True
    arguments: dict[str, dict] = field(default_factory=dict)  # name -> the schema its call's arguments match

    @property
    def names(self) -> list[str]:
        return [f["name"] for f in self.functions]


def tool_request(tools: list[dict] | None, tool_choice: str | dict | None,
                 parallel_tool_calls: bool | None) -> ToolRequest | None:
    """The request's tools checked (400s naming the field); None when no tool may be called."""
    if tool_choice is not None and not tools:
        if tool_choice == "none":
            return None
        raise _bad("tool_choice", "needs tools")
    if not tools:
        return None
    functions, grammar_params = [], {}
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise _bad(f"tools.{i}", "only function tools ({'type': 'function', 'function': {...}}) are supported")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad(f"tools.{i}.function", "needs a name")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise _bad(f"tools.{i}.function.parameters", "must be a JSON schema object")
        functions.append({"name": fn["name"], "description": fn.get("description", ""), "parameters": params})
        # the call's arguments are held to the declared properties unless the schema says otherwise
        # (OpenAI's strict mode; a small model otherwise invents fields)
        grammar_params[fn["name"]] = ({"additionalProperties": False, **params} if params.get("type") == "object"
                                      else params)
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise _bad("tools", "function names must be unique")
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name not in names:
            raise _bad("tool_choice", f"names no function among the tools ({', '.join(names)})")
        choice = name
    elif choice == "none":
        return None
    elif choice not in ("auto", "required"):
        raise _bad("tool_choice", "must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                   "{'name': ...}}")
    return ToolRequest(tuple(functions), choice, parallel_tool_calls is not False, grammar_params)


def _bad(param: str, why: str) -> InvalidSamplingParams:
    return InvalidSamplingParams(f"{param}: {why}", param=param)


# ---- the prompt ---------------------------------------------------------------------------------
def system_prompt(request: ToolRequest) -> str:
    """The tools as a system message section, for templates that do not render `tools`."""
    lines = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in request.functions)
    return ("You can call functions to help with the user's request. Their signatures are listed inside "
            f"<tools></tools> tags:\n<tools>\n{lines}\n</tools>\n"
            "To call a function, answer with a JSON object holding its name and arguments inside "
            f"{CALL_OPEN}{CALL_CLOSE} tags, like this:\n"
            f'{CALL_OPEN}\n{{"name": "function_name", "arguments": {{"argument": "value"}}}}\n{CALL_CLOSE}\n'
            "A function's result comes back inside <tool_response></tool_response> tags.\n"
            "Answer the user with the function results.")


def render_messages(messages: list[dict], request: ToolRequest | None) -> list[dict]:
    """Messages for a template that knows no tools: the tools in the system message, earlier
    assistant calls as `<tool_call>` text, tool results inside `<tool_response>` tags. A
    conversation with neither tools nor calls is left as it is."""
    if request is None and not any(m.get("tool_calls") for m in messages):
        return list(messages)
    out = []
    for m in messages:
        m = dict(m)
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = "\n".join(_call_text(c) for c in m.pop("tool_calls"))
            m["content"] = f"{m.get('content') or ''}\n{calls}".strip()
        elif m.get("role") == "tool":
            m["content"] = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
        out.append(m)
    if request is not None:
        section = system_prompt(request)
        if out and out[0].get("role") in ("system", "developer"):
            out[0] = {**out[0], "role": "system", "content": f"{out[0].get('content') or ''}\n\n{section}".strip()}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def _call_text(call: dict) -> str:
    fn = call.get("function") or {}
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass
    return f"{CALL_OPEN}\n{json.dumps({'name': fn.get('name'), 'arguments': args}, ensure_ascii=False)}\n{CALL_CLOSE}"


# ---- the grammar --------------------------------------------------------------------------------
def tool_grammar(request: ToolRequest, answer: StructuredOutputs | None = None) -> str:
    """A Lark grammar (llguidance's dialect) for the request's output. `answer`: what a reply that
    calls no tool must match (a response_format), under `auto`."""
    functions = [f for f in request.functions if request.choice in ("auto", "required") or f["name"] == request.choice]
    schema = {"anyOf": [{"type": "object",
                         "properties": {"name": {"const": f["name"]},
                                        "arguments": request.arguments.get(f["name"], f["parameters"])},
                         "required": ["name", "arguments"], "additionalProperties": False} for f in functions]}
    body = f'"\\n" {json_schema_lark(schema)} "\\n{CALL_CLOSE}"'
    more = '("\\n" call)*' if request.parallel and request.choice in ("auto", "required") else ""  # named: one
    if request.choice == "auto" and answer is not None:  # calls, or the answer in its format
        return (f"%llguidance {{}}\nstart: call {more} | answer\ncall: \"{CALL_OPEN}\" {body}\n"
                f"answer: {answer_lark(answer)}\n")
    if request.choice == "auto":  # free text; a call's syntax is forced from its opening tag on
        return (f"%llguidance {{}}\nstart: (call)* TEXT\ncall: open {body} \nopen[lazy]: TEXT \"{CALL_OPEN}\"\n"
                "TEXT: /(.|\\n)*/\n")
    return f"%llguidance {{}}\nstart: call {more}\ncall: \"{CALL_OPEN}\" {body}\n"


# ---- the parser ---------------------------------------------------------------------------------
def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def call_object(payload: str) -> dict | None:
    """An OpenAI tool call from a `<tool_call>` block's JSON; None if it is not a call."""
    try:
        data = json.loads(payload)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    args = data.get("arguments", data.get("parameters", {}))
    return {"id": new_call_id(), "type": "function",
            "function": {"name": data["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content outside the calls or None, the calls) of a whole output."""
    parser = ToolStreamParser()
    events = parser.feed(text) + parser.finish()
    content = "".join(e for e in events if isinstance(e, str))
    calls = [e for e in events if isinstance(e, dict)]
    return (content or None), calls


class ToolStreamParser:
    """Splits streamed text into content pieces (str) and whole calls (dict). Text that may start a
    `<tool_call>` tag is held back until it does or cannot; a block that is not a valid call stays
    content."""

    def __init__(self) -> None:
        self._buf = ""
        self._in_call = False
        self._blank = ""  # whitespace held until text follows (dropped around calls and at the end)
        self._trim = True  # at the start or after a call: leading whitespace is dropped

    def feed(self, text: str) -> list[str | dict]:
        return self._tidy(self._split(text))

    def finish(self) -> list[str | dict]:
        """What is left at the end: an unclosed block is content."""
        rest = (CALL_OPEN if self._in_call else "") + self._buf
        self._buf, self._in_call = "", False
        out = self._tidy([rest] if rest else [])
        self._blank = ""
        return out

    def _tidy(self, pieces: list[str | dict]) -> list[str | dict]:
        """Content without the whitespace around calls and at either end, however it was split."""
        out: list[str | dict] = []
        for piece in pieces:
            if isinstance(piece, dict):
                self._blank, self._trim = "", True
                out.append(piece)
                continue
            if self._trim:
                piece = piece.lstrip()
            body = piece.rstrip()
            if body:
                out.append(self._blank + body)
                self._trim = False
                self._blank = piece[len(body):]
            else:
                self._blank += piece
        return out

    def _split(self, text: str) -> list[str | dict]:
        self._buf += text
        out: list[str | dict] = []
        while True:
            if self._in_call:
                end = self._buf.find(CALL_CLOSE)
                if end < 0:
                    return out
                payload, self._buf = self._buf[:end], self._buf[end + len(CALL_CLOSE):]
                self._in_call = False
                call = call_object(payload.strip())
                out.append(call if call is not None else f"{CALL_OPEN}{payload}{CALL_CLOSE}")
                continue
            at = self._buf.find(CALL_OPEN)
            if at >= 0:
                if at:
                    out.append(self._buf[:at])
                self._buf, self._in_call = self._buf[at + len(CALL_OPEN):], True
                continue
            keep = _partial_tag(self._buf)
            if len(self._buf) > keep:
                out.append(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
            return out


def _partial_tag(text: str) -> int:
    """How many trailing characters of `text` could begin `<tool_call>`."""
    for n in range(min(len(text), len(CALL_OPEN) - 1), 0, -1):
        if CALL_OPEN.startswith(text[-n:]):
            return n
    return 0
