"""The HTTP API's request and response bodies (pydantic), shaped like OpenAI's and vLLM's.

These models are also the server's OpenAPI schema, which the tests fuzz with schemathesis: every
field a handler reads is declared here with its range, so that a request the schema allows never
crashes the server, and every response validates against the model it is declared with.

Optional fields accept `null` (OpenAI clients send it for "not given"). Fields OpenAI defines but
kvc does not implement (suffix, ...) are declared so that a request using them gets a clear
400 instead of being silently ignored. Request bodies are strict (`RequestModel`):
no coercion (`0` is not a bool, `"2"` not an integer) and an unknown field is a 400 naming it,
unless the server runs with `--allow-extra-fields` (then unknown fields are dropped).
"""

from __future__ import annotations

import logging
import time
import uuid
from contextvars import ContextVar
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvc.runtime.sampling_params import LOGIT_BIAS_MAX, MAX_LOGPROBS, SEED_MAX, SEED_MIN

MAX_N = 128  # choices per prompt
MAX_CHAIN_ID_LEN = 128

log = logging.getLogger(__name__)

NonNegInt = Annotated[int, Field(ge=0)]
ChainId = Annotated[str, Field(min_length=1, max_length=MAX_CHAIN_ID_LEN)]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# ---- requests ---------------------------------------------------------------------------------
# Set per request by the server (middleware.ExtraFieldsPolicy): drop unknown fields instead of refusing them.
ALLOW_EXTRA_FIELDS: ContextVar[bool] = ContextVar("kvc_allow_extra_fields", default=False)


class RequestModel(BaseModel):
    """A request body, strict like OpenAI's schema: values keep their JSON type and unknown fields
    are refused (FastAPI's error names them), or dropped where `ALLOW_EXTRA_FIELDS` is set."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _drop_unknown_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict) or cls.model_config.get("extra") != "forbid" or not ALLOW_EXTRA_FIELDS.get():
            return data
        known = {field.alias or name for name, field in cls.model_fields.items()}
        unknown = [k for k in data if k not in known]
        if unknown:
            log.debug("ignoring unknown request field(s) of %s: %s", cls.__name__, ", ".join(map(str, unknown)))
            data = {k: v for k, v in data.items() if k in known}
        return data


class StreamOptions(RequestModel):
    include_usage: bool | None = False


class StructuredOutputsRequest(RequestModel):
    """vLLM's `structured_outputs`: what the output must match (exactly one field)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="a JSON schema")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = Field(None, description="a Lark grammar (llguidance's dialect)")


class KvcOptions(RequestModel):
    """kvc's per-request options (OpenAI clients send them as `extra_body={"kvc": {...}}`)."""

    method: str | None = Field(None, min_length=1,
                               description="the KV method the request runs: one the server serves (GET /v1/models); "
                                           "default: the server's --method")
    params: dict[str, Any] | None = Field(None, description="the method's parameters for this request, over the "
                                                            "served ones (their ranges: GET /v1/models)")


class GenerationRequest(RequestModel):
    """Fields shared by completions and chat completions."""

    model: str | None = Field(None, description="the served model name; omitted: the one model served")
    temperature: float | None = Field(None, ge=0, description="0 is greedy; default 1")
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=MAX_N, description="choices to generate per prompt")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(None, description="up to any number of stop strings")
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    user: str | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2, description="minus this for each token already generated")
    frequency_penalty: float | None = Field(None, ge=-2, le=2,
                                           description="minus this times how often each token was generated")
    logit_bias: dict[str, Annotated[float, Field(ge=-LOGIT_BIAS_MAX, le=LOGIT_BIAS_MAX)]] | None = Field(
        None, description="token id (a string) -> added to its logit")
    # vLLM's and kvc's own fields (OpenAI clients send them through `extra_body`)
    top_k: int | None = Field(None, ge=-1, description="0 or -1: no limit")
    min_p: float | None = Field(None, ge=0, le=1, description="drop tokens below min_p x the top token's probability")
    repetition_penalty: float | None = Field(
        None, gt=0, description="prompt and output tokens: logit / r if positive, else x r; 1: none")
    min_tokens: NonNegInt | None = Field(None, description="EOS, stop tokens and stop strings count only after these")
    stop_token_ids: list[NonNegInt] | None = None
    ignore_eos: bool | None = False
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    return_token_ids: bool | None = Field(
        False, description="kvc: each choice (and stream chunk) also carries its new token ids"
    )
    structured_outputs: StructuredOutputsRequest | None = Field(
        None, description="vLLM's: the output matches a JSON schema, regex, choice or grammar")
    kvc: KvcOptions | None = Field(None, description="kvc: the request's KV method and its parameters")
    # kvc's chain cache (at most one of the three; n and best_of must be 1)
    chain: bool | None = Field(None, description="kvc: open a chain: keep this request's KV for the next turn")
    chain_id: ChainId | None = Field(None, description="kvc: continue this chain (resend the whole conversation)")
    chain_fork: ChainId | None = Field(None, description="kvc: fork this chain into a new one and continue that")


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(GenerationRequest):
    prompt: Prompt = Field(description="text, token ids, or a batch of either")
    max_tokens: int | None = Field(None, ge=0, description="default 16; 0 only with echo (the prompt's logprobs)")
    echo: bool | None = Field(False, description="the prompt (and with logprobs its logprobs) before the output")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="per token its logprob and the top N")
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None


class TextContent(RequestModel):
    type: Literal["text"]
    text: str


class ChatMessage(RequestModel):
    model_config = ConfigDict(extra="allow")  # tool_call_id, name, ... pass to the chat template

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContent] | None = None


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="deprecated by OpenAI; max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1, description="default: the rest of the context")
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="with logprobs: the top N per token")
    tools: list[dict[str, Any]] | None = Field(None, description="function tools (Hermes <tool_call> format)")
    tool_choice: str | dict[str, Any] | None = Field(None, description="'none', 'auto' (default with tools), "
                                                     "'required' or a named function (constrained decoding)")
    parallel_tool_calls: bool | None = Field(None, description="several calls in one answer (default true)")
    response_format: dict[str, Any] | None = Field(None, description="text, json_object or json_schema "
                                                   "(constrained decoding)")
    add_generation_prompt: bool | None = True


class TokenizeRequest(RequestModel):
    """Either `prompt` (text) or `messages` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = False
    add_generation_prompt: bool | None = True


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


# ---- responses --------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy logprobs: per token its text, logprob (null for a prompt's first token), top
    logprobs (text -> logprob, the token's own among them) and where its text starts in the choice's."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = Field(None, description="vLLM: the stop token id or stop string that ended it")
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    chain_id: str | None = Field(None, description="kvc: the chain this request continues or opened")
    system_fingerprint: str | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="a JSON object as text")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = Field(None, description="vLLM: the stop token id or stop string that ended it")
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    chain_id: str | None = Field(None, description="kvc: the chain this request continues or opened")
    system_fingerprint: str | None = None


class ToolCallDelta(ToolCall):
    index: int


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = Field(None, description="each call whole, in one delta")


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion (the stream ends with `data: [DONE]`)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    chain_id: str | None = Field(None, description="kvc: the chain this request continues or opened")


class CompletionChunk(BaseModel):
    """One server-sent event of a streamed completion (the stream ends with `data: [DONE]`)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    chain_id: str | None = Field(None, description="kvc: the chain this request continues or opened")


class MethodParameter(BaseModel):
    value: Any = Field(description="the value requests run with unless they give another")
    type: str = Field(description="its type as the .kvm declares it (tokens, int, float, ratio, or a choice)")


class MethodCard(BaseModel):
    """kvc: one KV method the server runs."""

    name: str
    default: bool = Field(description="whether requests that name no method run it")
    parameters: dict[str, MethodParameter]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvc"
    root: str | None = None
    max_model_len: int
    vocab_size: int = Field(description="kvc: token ids are in [0, vocab_size)")
    method: str = Field(description="kvc: the KV-cache method requests run by default")
    methods: list[MethodCard] = Field(default_factory=list, description="kvc: every KV method a request may choose "
                                                                          "(`extra_body={\"kvc\": {\"method\": ...}}`)")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class HealthResponse(BaseModel):
    status: Literal["ok", "shutting_down"]


class ChainInfo(BaseModel):
    """kvc: a chain as GET /v1/chains/{id} shows it."""

    id: str
    object: Literal["chain"] = "chain"
    tokens: int = Field(description="tokens of the chain's logical history")
    state: Literal["active", "idle"] = Field(description="active: a request is running on it")
    last_used: float = Field(description="unix time of the end of its last turn (or of its opening)")
    pages: int = Field(description="KV pages the chain holds (pages shared with forks count in each)")
    stored_tokens: int | None = Field(None, description="tokens stored, the most-storing KV head of each "
                                      "layer summed over layers")
    messages: int | None = Field(None, description="chat messages recorded (null: a raw prompt)")


class ChainList(BaseModel):
    """kvc: GET /v1/chains: the caller's chains, most recently used first."""

    object: Literal["list"] = "list"
    data: list[ChainInfo]


class ChainPruneRequest(RequestModel):
    """kvc: POST /v1/chains/{id}/prune. Selectors add up; `older_than_rounds` limits the message
    selectors to messages followed by at least that many assistant messages. Each selected range
    keeps `keep` (a fraction) or `keep_tokens` of its stored tokens per layer and KV head, the
    best-scored by `scorer` (a method name; default: the server's --prune-scorer, else the served
    method's own token scores)."""

    token_ranges: list[Annotated[list[NonNegInt], Field(min_length=2, max_length=2)]] | None = Field(
        None, max_length=4096, description="logical token ranges [start, end) of the chain's history")
    messages: list[NonNegInt] | None = Field(None, max_length=4096, description="message indices")
    roles: list[Annotated[str, Field(min_length=1, max_length=64)]] | None = Field(None, max_length=16)
    older_than_rounds: NonNegInt | None = 0
    keep: float | None = Field(None, ge=0.0, lt=1.0, description="fraction of each range to keep")
    keep_tokens: NonNegInt | None = Field(None, description="tokens of each range to keep")
    scorer: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    scorer_params: dict[str, Any] | None = None


class ChainPruned(BaseModel):
    """kvc: what a prune did. Stored tokens count the most-storing KV head of each layer, summed
    over layers; `dropped` counts per range the slots dropped over layers and KV heads."""

    id: str
    object: Literal["chain.prune"] = "chain.prune"
    ranges: list[list[int]]
    tokens: int = Field(description="tokens of the chain's logical history (unchanged: matching stays valid)")
    stored_tokens_before: int
    stored_tokens: int
    pages_before: int
    pages: int
    dropped: list[int]


class ChainCreateRequest(RequestModel):
    """kvc: POST /v1/chains: a chain holding a prefix (a cached prompt), computed and not extended,
    to prune or continue later."""

    model: str | None = None
    prompt: str | Annotated[list[NonNegInt], Field(min_length=1)] | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool | None = False


class ChainDeleted(BaseModel):
    id: str
    object: Literal["chain"] = "chain"
    deleted: Literal[True] = True


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
