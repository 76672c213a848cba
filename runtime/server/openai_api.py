"""The OpenAI endpoints' logic: request body -> token ids and `SamplingParams` -> `Generation` ->
a JSON response or a server-sent event stream.

Routing, auth and error handling live in `app.py`; this module only knows the request shapes.
Chained requests (`chain` / `chain_id` / `chain_fork`, or any chat with `--auto-chain`; docs/serving.md,
"Chains") are validated here and carry a `ChainSpec` to the engine; their response (and last stream
chunk) names the chain in `chain_id`, and their headers in `x-kvc-chain-id`. Tokenization and chat
templates run in the server's tokenizer threads (`ServingContext.offload`), never on the event loop.
Logprobs are shaped in `logprobs.py`; `echo` puts each prompt (and its logprobs) before the output.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import functools
import json
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, StreamingResponse
from jinja2 import TemplateError

from kvc.runtime.chain_prune import PruneRequest, Segment
from kvc.runtime.chains import ChainSpec
from kvc.runtime.errors import InvalidPromptError, InvalidSamplingParams, PromptTooLongError
from kvc.runtime.sampling_params import SamplingParams
from kvc.runtime.server.async_engine import AsyncEngine
from kvc.runtime.server.auth import request_owner
from kvc.runtime.server.errors import EngineFailed, ModelNotFound, error_body
from kvc.runtime.server.generation import Choice, Generation
from kvc.runtime.server.logprobs import CompletionLogprobs, chat_logprobs
from kvc.runtime.server.metrics import ServerMetrics
from kvc.runtime.server.protocol import (
    ChainCreateRequest,
    ChainPruneRequest,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    GenerationRequest,
    now,
    random_id,
)
from kvc.runtime.server.text import TokenStrings
from kvc.runtime.server.tools import ToolRequest, ToolStreamParser, parse_tool_calls, tool_grammar, tool_request
from kvc.runtime.server.tools import render_messages as render_tool_messages
from kvc.runtime.structured_outputs import StructuredOutputs

log = logging.getLogger(__name__)

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions
CHAIN_ID_HEADER = "x-kvc-chain-id"


@dataclass
class ServingContext:
    """What the handlers need from the server."""

    aengine: AsyncEngine
    metrics: ServerMetrics
    tokenizer: Any  # a transformers tokenizer, or None for a model without one
    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    tokenizer_pool: Executor | None = None  # None: the event loop's default executor
    auto_chain_min_tokens: int | None = None  # --auto-chain: chats continue the chain they extend

    async def offload(self, fn: Callable, *args):
        """`fn(*args)` in a tokenizer thread: a long prompt's tokenization or chat template never
        holds the event loop (other requests' streams go on)."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, functools.partial(fn, *args))

    @functools.cached_property
    def token_strings(self) -> TokenStrings:
        """Each token's text and bytes, for logprobs (cached over requests)."""
        return TokenStrings(self.tokenizer)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ModelNotFound(f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                                param="model")

    def encode(self, text: str, param: str, add_special_tokens: bool = False) -> list[int]:
        if self.tokenizer is None:
            raise InvalidPromptError(
                "this model has no tokenizer; send prompts as token ids to /v1/completions", param=param
            )
        _check_unicode(text, param)
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except Exception:  # the backend's message names its internal types: logged, not sent
            log.warning("the tokenizer failed on %s", param, exc_info=True)
            raise InvalidPromptError(f"cannot tokenize {param}: the tokenizer rejected the text", param=param) from None

    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool,
                    tools: ToolRequest | None = None) -> list[int]:
        text, _, _ = self._chat_text(messages, add_generation_prompt, tools)
        return self.encode(text, "messages")

    def render_chat_segments(self, messages: list[ChatMessage], add_generation_prompt: bool,
                             tools: ToolRequest | None = None) -> tuple[list[int], tuple[Segment, ...] | None]:
        """The rendered prompt and each message's content as a token range (for a chain's prunes by
        message); segments None when the tokenizer gives no character offsets."""
        text, contents, roles = self._chat_text(messages, add_generation_prompt, tools)
        if not getattr(self.tokenizer, "is_fast", False):
            return self.encode(text, "messages"), None
        _check_unicode(text, "messages")
        try:
            enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        except Exception:
            log.warning("the tokenizer failed on messages", exc_info=True)
            raise InvalidPromptError("cannot tokenize messages: the tokenizer rejected the text",
                                     param="messages") from None
        ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
        segments = message_segments(text, contents, roles, offsets)
        return ids, segments[len(segments) - len(messages):]  # a system message kvc added has none

    @functools.cached_property
    def template_renders_tools(self) -> bool:
        """Does the chat template write `tools` into the prompt itself (else kvc does, runtime/server/tools.py)?"""
        probe = [{"type": "function", "function": {"name": "kvc_probe_function", "parameters": {"type": "object"}}}]
        try:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=probe,
                                                      add_generation_prompt=True, tokenize=False)
        except Exception:
            return False
        return "kvc_probe_function" in text

    def _chat_text(self, messages: list[ChatMessage], add_generation_prompt: bool, tools: ToolRequest | None = None
                   ) -> tuple[str, list[str], list[str]]:
        """The rendered chat, and each rendered message's content and role (kvc's tools section
        may add a system message first)."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise InvalidPromptError("this model has no chat template; use /v1/completions", param="messages")
        plain = []
        for m in messages:
            d = m.model_dump(exclude_none=True)
            if isinstance(m.content, list):
                d["content"] = "\n".join(part.text for part in m.content)
            d.setdefault("content", "")
            for key, value in d.items():
                if isinstance(value, str):
                    _check_unicode(value, f"messages.{len(plain)}.{key}")
            plain.append(d)
        extra = {}
        native = self.template_renders_tools
        if native and tools is not None:
            extra["tools"] = [{"type": "function", "function": f} for f in tools.functions]
        elif not native:  # calls, results and the tools section written in the Hermes format
            plain = render_tool_messages(plain, tools)
        try:
            text = self.tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt,
                                                      tokenize=False, **extra)
        except TemplateError as e:  # raise_exception() in a template: its words, for the client
            raise InvalidPromptError(f"the chat template rejected the messages: {e}", param="messages") from None
        except Exception:  # anything else names the template engine's internals: logged, not sent
            log.warning("the chat template failed", exc_info=True)
            raise InvalidPromptError("the chat template could not render the messages", param="messages") from None
        return text, [d["content"] for d in plain], [d["role"] for d in plain]


def _check_unicode(text: str, param: str) -> None:
    """400 for text that is not valid Unicode (JSON allows a lone surrogate such as \\ud800)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidPromptError(f"{param} is not valid Unicode: a lone surrogate (U+{ord(text[e.start]):04X}) at "
                                 f"character {e.start}", param=param) from None


def message_segments(text: str, contents: list[str], roles: list[str],
                     offsets: list[tuple[int, int]]) -> tuple[Segment, ...]:
    """Each message's content located in the rendered `text` (in order), as the token range that
    covers it; a content the template changed or dropped gets an empty range."""
    ends = [end for _, end in offsets]
    segments, cursor, token = [], 0, 0
    for content, role in zip(contents, roles):
        at = text.find(content, cursor) if content else -1
        if at < 0:
            segments.append(Segment(role, token, token))
            continue
        cursor = at + len(content)
        start = bisect.bisect_right(ends, at)  # the first token ending past the content's start
        end = bisect.bisect_left(ends, cursor) + 1  # through the token holding its last character
        end = min(end, len(offsets))
        segments.append(Segment(role, start, end))
        token = end
    return tuple(segments)


def _reject(param: str, why: str) -> InvalidSamplingParams:
    return InvalidSamplingParams(f"{param}: {why}", param=param)


def _check_common(req: GenerationRequest) -> None:
    if req.stop is not None:
        stops = [req.stop] if isinstance(req.stop, str) else req.stop
        if any(s == "" for s in stops):
            raise _reject("stop", "stop strings must not be empty")


def _chain_spec(ctx: ServingContext, req: GenerationRequest, http: HttpRequest, chat: bool = False
                ) -> ChainSpec | None:
    """The request's chain fields as a ChainSpec (None for a plain request); 400 when they clash.
    With --auto-chain, a chat that names no chain and generates one sequence is an automatic one."""
    given = [name for name, value in (("chain", req.chain), ("chain_id", req.chain_id),
                                      ("chain_fork", req.chain_fork)) if value]
    if not given:
        if chat and ctx.auto_chain_min_tokens is not None and (req.n or 1) == 1:
            return ChainSpec(auto=True, auto_min_tokens=ctx.auto_chain_min_tokens, owner=request_owner(http.scope))
        return None
    if len(given) > 1:
        raise _reject(given[1], f"give at most one of chain, chain_id and chain_fork (got {', '.join(given)})")
    name = given[0]
    if (req.n or 1) > 1:
        raise _reject("n", f"a chained request ({name}) generates one sequence; n must be 1")
    if (getattr(req, "best_of", None) or 1) > 1:
        raise _reject("best_of", f"a chained request ({name}) generates one sequence; best_of must be 1")
    return ChainSpec(open=name == "chain", continue_id=req.chain_id, fork_id=req.chain_fork,
                     owner=request_owner(http.scope))


def _params(req: GenerationRequest, max_tokens: int, logprobs: int | None = None,
            prompt_logprobs: int | None = None, structured: StructuredOutputs | None = None) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        seed=req.seed,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=bool(req.ignore_eos),
        min_tokens=req.min_tokens or 0,
        min_p=req.min_p or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=_logit_bias(req.logit_bias),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        structured_outputs=structured,
        method=None if req.kvc is None else req.kvc.method,
        method_params=None if req.kvc is None else req.kvc.params,
    )


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias keys are token ids written as strings."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise _reject("logit_bias", f"keys are token ids; got {key!r}") from None
        if token < 0:
            raise _reject("logit_bias", f"token ids are non-negative; got {key!r}")
        out[token] = value
    return out


def _check_length(ctx: ServingContext, prompt: list[int], max_tokens: int, param: str) -> None:
    n = len(prompt)
    if n >= ctx.max_model_len:
        raise PromptTooLongError(
            f"the prompt has {n} tokens, but the model's context is {ctx.max_model_len} tokens "
            "(prompt plus at least one new token must fit)", param=param)
    if n + max_tokens > ctx.max_model_len:
        raise _reject("max_tokens", f"the prompt has {n} tokens and max_tokens is {max_tokens}, but the "
                      f"model's context is {ctx.max_model_len} tokens; lower max_tokens")


def _completion_prompts(ctx: ServingContext, prompt) -> list[list[int]]:
    if isinstance(prompt, str):
        return [ctx.encode(prompt, "prompt")]
    if not prompt:
        raise InvalidPromptError("the prompt is empty", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        return [ctx.encode(p, "prompt") for p in prompt]
    if all(isinstance(t, int) for t in prompt):
        return [list(prompt)]
    return [list(p) for p in prompt]


async def _start(ctx: ServingContext, req: GenerationRequest, prompts: list[list[int]], max_tokens: int,
                 http: HttpRequest, chain: ChainSpec | None, logprobs: int | None = None,
                 prompt_logprobs: int | None = None, structured: StructuredOutputs | None = None) -> Generation:
    n = req.n or 1
    if len(prompts) * n > ctx.aengine.max_waiting:
        raise _reject("n", f"the request asks for {len(prompts) * n} sequences; this server queues at most "
                      f"{ctx.aengine.max_waiting} at once")
    if structured is not None:  # compiled (and refused) in a tokenizer thread, not on the loop or the engine's
        await ctx.offload(structured.to_grammar)
    params = _params(req, max_tokens, logprobs, prompt_logprobs, structured)
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    gen = Generation(ctx.aengine, ctx.metrics, ctx.tokenizer, ctx.eos_token_ids, prompts,
                     [params] * len(prompts), n, stops, bool(req.include_stop_str_in_output),
                     req.skip_special_tokens is not False, chain)
    await gen.start(http)
    return gen


# ---- /v1/completions --------------------------------------------------------------------------
async def create_completion(ctx: ServingContext, req: CompletionRequest, http: HttpRequest):
    ctx.check_model(req.model)
    _check_common(req)
    chain = _chain_spec(ctx, req, http)
    if req.suffix:
        raise _reject("suffix", "not supported by kvc")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise _reject("best_of", "only best_of == n is supported")
    echo = bool(req.echo)
    if req.max_tokens == 0 and not echo:
        raise _reject("max_tokens", "must be at least 1 (0 only with echo: the prompt and its logprobs)")
    # echo with max_tokens 0 (lm-eval's loglikelihood): generate one token and show none (vLLM's way)
    echo_only = echo and req.max_tokens == 0
    prompts = await ctx.offload(_completion_prompts, ctx, req.prompt)
    if chain is not None and len(prompts) > 1:
        raise InvalidPromptError("a chained request takes one prompt, not a batch", param="prompt")
    max_tokens = 1 if echo_only else req.max_tokens or DEFAULT_COMPLETION_TOKENS
    for p in prompts:
        _check_length(ctx, p, max_tokens, "prompt")
    prompt_logprobs = req.logprobs if echo else None
    gen = await _start(ctx, req, prompts, max_tokens, http, chain, None if echo_only else req.logprobs,
                       prompt_logprobs, structured=_structured_outputs(req))
    rid, created = random_id("cmpl"), now()
    with_ids = bool(req.return_token_ids)
    want_logprobs = req.logprobs is not None
    prompt_texts = await ctx.offload(_prompt_texts, ctx, req.prompt, prompts) if echo else None
    builders = [CompletionLogprobs(ctx.token_strings) for _ in gen.choices]

    def chunk(choices: list[dict], usage: dict | None = None, last: bool = False) -> dict:
        body = {"id": rid, "object": "text_completion", "created": created, "model": ctx.model_name,
                "choices": choices}
        if usage is not None or include_usage:
            body["usage"] = usage
        return _with_chain(body, gen, last)

    def choice(c: Choice, text: str, ids: list[int], logprobs: list | None, first: bool, reason: str | None) -> dict:
        """A choice (or its stream delta); the first one of an echoing request starts with its prompt."""
        if echo_only:
            text, ids, logprobs = "", [], []
        shown = list(ids)
        if echo and first:
            prompt = prompts[c.prompt_index]
            text = prompt_texts[c.prompt_index] + text
            shown = prompt + shown
            logprobs = (c.prompt_logprobs or [None] * len(prompt)) + list(logprobs or [])
        out = {"index": c.index, "text": text,
               "logprobs": builders[c.index].add(shown, logprobs or []) if want_logprobs else None,
               "finish_reason": reason, "stop_reason": c.stop_reason if reason else None}
        if with_ids:
            out["token_ids"] = ids
        return out

    def usage() -> dict:
        u = gen.usage()
        if echo_only:  # the token generated to get there is not shown
            u["completion_tokens"], u["total_tokens"] = 0, u["prompt_tokens"]
        return u

    include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
    if req.stream:
        async def events() -> AsyncIterator[dict]:
            started = set()
            async for step in gen.deltas():
                for d in step:
                    first = d.index not in started
                    started.add(d.index)
                    if (d.text or d.finish_reason or ((with_ids or want_logprobs) and d.token_ids)
                            or (echo and first)):
                        yield chunk([choice(gen.choices[d.index], d.text, d.token_ids, d.logprobs, first,
                                            d.finish_reason)], last=d.finish_reason is not None)
            if include_usage:
                yield chunk([], usage(), last=True)

        return _sse(gen, events())

    await _collect(gen)
    return JSONResponse(chunk([choice(c, c.text.text, c.text.token_ids, c.output_logprobs, True, c.finish_reason)
                               for c in gen.choices], usage(), last=True), headers=_chain_header(gen))


def _prompt_texts(ctx: ServingContext, prompt, prompts: list[list[int]]) -> list[str]:
    """Each prompt as text, for echo: as sent, or decoded from token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if ctx.tokenizer is None:
        return ["" for _ in prompts]
    return [ctx.tokenizer.decode(p) for p in prompts]


# ---- /v1/chat/completions ---------------------------------------------------------------------
async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, http: HttpRequest):
    ctx.check_model(req.model)
    _check_common(req)
    chain = _chain_spec(ctx, req, http, chat=True)
    if req.top_logprobs is not None and not req.logprobs:
        raise _reject("top_logprobs", "needs logprobs: true")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    tools = tool_request(req.tools, req.tool_choice, req.parallel_tool_calls)
    structured = _response_format(req.response_format)
    if structured is not None and req.structured_outputs is not None:
        raise _reject("structured_outputs", "give response_format or structured_outputs, not both")
    structured = structured or _structured_outputs(req)
    if tools is not None:  # the calls' syntax (and a named or required call) by constrained decoding
        structured = StructuredOutputs(grammar=tool_grammar(tools, structured))
    if chain is None:
        prompt = await ctx.offload(ctx.render_chat, req.messages, req.add_generation_prompt is not False, tools)
    else:  # a chain records where each message's tokens are (prunes by message index or role)
        prompt, segments = await ctx.offload(ctx.render_chat_segments, req.messages,
                                             req.add_generation_prompt is not False, tools)
        chain = dataclasses.replace(chain, segments=segments)
    max_tokens = req.max_completion_tokens or req.max_tokens or max(1, ctx.max_model_len - len(prompt))
    _check_length(ctx, prompt, max_tokens, "messages")
    gen = await _start(ctx, req, [prompt], max_tokens, http, chain, logprobs, structured=structured)
    rid, created = random_id("chatcmpl"), now()
    with_ids = bool(req.return_token_ids)
    include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)

    def chunk(choices: list[dict], usage: dict | None = None, last: bool = False) -> dict:
        body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": ctx.model_name,
                "choices": choices}
        if usage is not None or include_usage:
            body["usage"] = usage
        return _with_chain(body, gen, last)

    def shaped(entries: list | None) -> dict | None:
        return None if logprobs is None else chat_logprobs(entries or [], ctx.token_strings)

    def delta_choice(index: int, delta: dict, reason: str | None, ids: list[int] | None,
                     entries: list | None = None) -> dict:
        c = {"index": index, "delta": delta, "logprobs": shaped(entries) if entries else None, "finish_reason": reason}
        if reason is not None:
            c["stop_reason"] = gen.choices[index].stop_reason
        if with_ids and ids is not None:
            c["token_ids"] = ids
        return c

    def finish_reason(reason: str | None, called: bool) -> str | None:
        return "tool_calls" if called and reason == "stop" else reason

    if req.stream:
        async def events() -> AsyncIterator[dict]:
            parsers = {c.index: ToolStreamParser() for c in gen.choices} if tools is not None else {}
            calls = {c.index: 0 for c in gen.choices}
            for c in gen.choices:
                yield chunk([delta_choice(c.index, {"role": "assistant", "content": ""}, None, None)])
            async for step in gen.deltas():
                for d in step:
                    pieces = [d.text] if not parsers else parsers[d.index].feed(d.text)
                    if d.finish_reason and parsers:
                        pieces += parsers[d.index].finish()
                    text = "".join(p for p in pieces if isinstance(p, str))
                    if text or ((with_ids or logprobs is not None) and d.token_ids):
                        yield chunk([delta_choice(d.index, {"content": text}, None, d.token_ids, d.logprobs)])
                    for call in (p for p in pieces if isinstance(p, dict)):
                        yield chunk([delta_choice(d.index, {"tool_calls": [{"index": calls[d.index], **call}]},
                                                  None, None)])
                        calls[d.index] += 1
                    if d.finish_reason:
                        yield chunk([delta_choice(d.index, {}, finish_reason(d.finish_reason, calls[d.index] > 0),
                                                  [])], last=True)
            if include_usage:
                yield chunk([], gen.usage(), last=True)

        return _sse(gen, events())

    await _collect(gen)
    choices = []
    for c in gen.choices:
        message = {"role": "assistant", "content": c.text.text}
        if tools is not None:
            message["content"], found = parse_tool_calls(c.text.text)
            if found:
                message["tool_calls"] = found
        item = {"index": c.index, "message": message, "logprobs": shaped(c.output_logprobs),
                "finish_reason": finish_reason(c.finish_reason, bool(message.get("tool_calls"))),
                "stop_reason": c.stop_reason}
        if with_ids:
            item["token_ids"] = c.text.token_ids
        choices.append(item)
    return JSONResponse(_with_chain({"id": rid, "object": "chat.completion", "created": created,
                                     "model": ctx.model_name, "choices": choices, "usage": gen.usage()}, gen, True),
                        headers=_chain_header(gen))


def _structured_outputs(req: GenerationRequest) -> StructuredOutputs | None:
    """vLLM's `structured_outputs` field as kvc's (None when absent)."""
    so = req.structured_outputs
    if so is None:
        return None
    return StructuredOutputs(json=so.json_, json_object=bool(so.json_object), regex=so.regex,
                             choice=None if so.choice is None else tuple(so.choice), grammar=so.grammar)


def _response_format(fmt: dict | None) -> StructuredOutputs | None:
    """OpenAI's response_format as structured outputs (None for text)."""
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise _reject("response_format", "json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}")
        return StructuredOutputs(json=spec.get("schema") or {"type": "object"})
    raise _reject("response_format", f"type must be 'text', 'json_object' or 'json_schema', not {kind!r}")


# ---- /v1/chains -------------------------------------------------------------------------------
async def create_chain(ctx: ServingContext, req: ChainCreateRequest, http: HttpRequest) -> dict:
    """A chain holding the prompt's K/V (computed once; a prefix-cache hit for `full`), nothing
    generated into it: a cached prefix that can be pruned, continued and forked."""
    ctx.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise _reject("prompt", "give exactly one of prompt and messages")
    segments = None
    if req.messages is not None:
        prompt, segments = await ctx.offload(ctx.render_chat_segments, req.messages, bool(req.add_generation_prompt))
    else:
        prompt = (await ctx.offload(_completion_prompts, ctx, req.prompt))[0]
    _check_length(ctx, prompt, 1, "prompt" if req.messages is None else "messages")
    chain = ChainSpec(open=True, owner=request_owner(http.scope), segments=segments)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    gen = Generation(ctx.aengine, ctx.metrics, ctx.tokenizer, ctx.eos_token_ids, [prompt], [params], 1, [],
                     False, True, chain)
    await gen.start(http)
    await _collect(gen)
    owner = chain.owner
    info = await ctx.aengine.call(lambda e: e.chain_info(gen.chain_id, owner))
    return {**info, "id": gen.chain_id}


async def prune_chain(ctx: ServingContext, chain_id: str, req: ChainPruneRequest, http: HttpRequest) -> dict:
    request = PruneRequest(
        token_ranges=tuple((a, b) for a, b in req.token_ranges or ()), messages=tuple(req.messages or ()),
        roles=tuple(req.roles or ()), older_than_rounds=req.older_than_rounds or 0, keep=req.keep,
        keep_tokens=req.keep_tokens, scorer=req.scorer, scorer_params=req.scorer_params)
    owner = request_owner(http.scope)
    return await ctx.aengine.call(lambda e: e.prune_chain(chain_id, owner, request))


# ---- shared -----------------------------------------------------------------------------------
def _chain_header(gen: Generation) -> dict | None:
    return None if gen.chain_id is None else {CHAIN_ID_HEADER: gen.chain_id}


def _with_chain(body: dict, gen: Generation, last: bool) -> dict:
    """The response, or a stream's closing chunks (finish_reason, usage), name the chain."""
    if last and gen.chain_id is not None:
        body["chain_id"] = gen.chain_id
    return body


async def _collect(gen: Generation) -> None:
    try:
        async for _ in gen.deltas():
            pass
    finally:
        gen.close()
    if gen.failed:
        raise EngineFailed("the engine failed while generating; see the server log")


def _sse(gen: Generation, events: AsyncIterator[dict]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                if gen.failed:
                    break
                yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
            if gen.failed:
                err = error_body(500, "the engine failed while generating; see the server log")
                yield f"data: {json.dumps(err)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            gen.close()

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(_chain_header(gen) or {})}
    return StreamingResponse(body(), media_type="text/event-stream", headers=headers)
