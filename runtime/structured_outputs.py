"""Structured outputs: what a request's output must match, as one llguidance grammar.

`StructuredOutputs` follows vLLM's field names (exactly one of `json`, `json_object`, `regex`,
`choice`, `grammar`); `grammar` is a Lark grammar in llguidance's dialect (lazy lexemes, `%json`
sub-grammars), which is how the server writes tool-call grammars (runtime/server/tools.py). The
sampler's token masks come from runtime/grammar_book.py. Why llguidance: docs/design.md,
"Structured outputs".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvc.runtime.errors import InvalidSamplingParams

# JSON whitespace between tokens: at most one space or newline run, so a small model cannot pad
# forever with blanks (llguidance's flexible whitespace would allow that)
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class StructuredOutputs:
    """What the generated text must match (give exactly one field)."""

    json: dict[str, Any] | str | None = None  # a JSON schema (dict or its text)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None  # one of these strings
    grammar: str | None = None  # a Lark grammar (llguidance's dialect)

    def __post_init__(self) -> None:
        given = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise InvalidSamplingParams(
                f"structured_outputs: give exactly one of json, json_object, regex, choice and grammar "
                f"(got {', '.join(given) or 'none'})", param="structured_outputs")
        if self.choice is not None:
            if isinstance(self.choice, str) or not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise InvalidSamplingParams("structured_outputs.choice: a non-empty list of strings",
                                            param="structured_outputs")
            object.__setattr__(self, "choice", tuple(self.choice))

    def to_grammar(self) -> str:
        """The llguidance grammar (a JSON text), compiled once per object; raises
        InvalidSamplingParams for a schema, regex or grammar that llguidance rejects."""
        if "_grammar" not in self.__dict__:
            self.__dict__["_grammar"] = self._compile()
        return self.__dict__["_grammar"]

    def schema(self) -> Any:
        """The JSON schema of a `json` or `json_object` output (a text schema parsed)."""
        if self.json_object:
            return {"type": "object"}
        if not isinstance(self.json, str):
            return self.json
        try:
            return json.loads(self.json)
        except ValueError as e:
            raise _bad(f"the JSON schema is not valid JSON: {e}") from None

    def _compile(self) -> str:
        import llguidance

        if self.json is not None or self.json_object:
            schema = self.schema()
            if not isinstance(schema, dict):
                raise _bad("the JSON schema must be an object")
            try:
                grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
            except (ValueError, TypeError) as e:
                raise _bad(f"the JSON schema was rejected: {e}") from None
        elif self.regex is not None:
            grammar = llguidance.LLMatcher.grammar_from_regex(self.regex)
        elif self.choice is not None:
            grammar = llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in self.choice))
        else:
            grammar = llguidance.LLMatcher.grammar_from_lark(self.grammar)
        error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
        if error:
            raise _bad(f"the grammar was rejected: {messages[0]}")
        return grammar


def _bad(why: str) -> InvalidSamplingParams:
    return InvalidSamplingParams(f"structured_outputs: {why}", param="structured_outputs")


def json_schema_lark(schema: dict[str, Any]) -> str:
    """`schema` as a Lark rule body (`%json {...}`), for grammars that embed JSON."""
    return "%json " + json.dumps({**schema, "x-guidance": _JSON_OPTIONS})


def answer_lark(outputs: StructuredOutputs) -> str:
    """A JSON structured output as a Lark rule body (tool grammars embed it as the no-call answer)."""
    if outputs.json is None and not outputs.json_object:
        raise InvalidSamplingParams("response_format: with tools, only json_object and json_schema combine",
                                    param="response_format")
    return json_schema_lark(outputs.schema())
