"""Generation: bounds checked here, then the request is relayed to the backend (streamed or not).

Chat and completions (OpenAI's), the Responses API (OpenAI's) and the Messages API (Anthropic's) have the same
bounds (length, prompt size, messages, tools, images) and the same accounting. A stream that breaks after it
started ends with a terminal SSE error event and no end marker ([DONE], response.completed, message_stop), so that a
client can never take a cut answer for a whole one. Token usage is counted in metrics; vLLM is always asked for usage
on chat and completion streams, and that chunk is passed on only if the client asked for it too (the Responses and
Messages streams carry theirs in their own events).
"""

from __future__ import annotations

import hashlib
import logging
import sys
from collections.abc import Awaitable, Callable

import orjson

from core.contract import TEXT_GENERATION

from ..access.keys import ApiKey
from ..backends.base import Stream, StreamBroken
from ..edge.recording import TRACE, hash_ids, note, note_first_chunk
from ..exceptions import InvalidRequest
from ..fleet.prefix import prefix_of, prompt_text
from ..inputs.chat import check_chat_images, messages_size
from ..settings import GatewaySettings
from ..state import GatewayState
from ..usage import count_usage
from .protocol import (ChatCompletionRequest, CompletionRequest, CountTokensRequest, DetokenizeRequest, MessagesRequest,
                       ResponsesRequest, TokenizeRequest)

log = logging.getLogger("rtxserve.gateway")
TASK = TEXT_GENERATION


def _prompt_size(request: ChatCompletionRequest | CompletionRequest) -> int:
    """Characters of text (token ids count one each) the backend will have to tokenize and prefill; images are
    bounded apart (inputs/chat.py)."""
    if isinstance(request, CompletionRequest):
        prompts = [request.prompt] if isinstance(request.prompt, str) or (
            request.prompt and isinstance(request.prompt[0], int)) else request.prompt
        return sum(len(p) for p in prompts)
    return messages_size(request.messages)


def _check_bounds(limits: GatewaySettings, request: ChatCompletionRequest | CompletionRequest) -> None:
    """Bound what costs money or memory; everything else is the backend's to judge."""
    _bound("max_tokens", request.max_tokens, limits.max_tokens)
    _bound("n", request.n, limits.max_n)
    _bound("best_of", request.best_of, limits.max_n)
    _check_stops(limits, request.stop_list(), "stop")
    size = _prompt_size(request)
    if size > limits.max_prompt_chars:
        raise InvalidRequest(f"the prompt has {size} characters; this gateway allows at most {limits.max_prompt_chars}",
                             param="messages" if isinstance(request, ChatCompletionRequest) else "prompt")
    if isinstance(request, CompletionRequest):
        _bound("logprobs", request.logprobs, limits.max_logprobs)
        return
    _bound("max_completion_tokens", request.max_completion_tokens, limits.max_tokens)
    _bound("top_logprobs", request.top_logprobs, limits.max_logprobs)
    if len(request.messages) > limits.max_messages:
        raise InvalidRequest(f"{len(request.messages)} messages; this gateway allows at most {limits.max_messages}",
                             param="messages")
    check_chat_images(limits, request.messages)
    _check_tools(limits, request.tools)


def _bound(field: str, value: int | None, limit: int) -> None:
    if value is not None and value > limit:
        raise InvalidRequest(f"{field} is {value}; this gateway allows at most {limit}", param=field)


def _check_stops(limits: GatewaySettings, stops: list[str], param: str) -> None:
    if len(stops) > limits.max_stop or any(len(s) > 256 for s in stops):
        raise InvalidRequest(f"at most {limits.max_stop} stop sequences of at most 256 characters", param=param)


def _check_tools(limits: GatewaySettings, tools: list[dict] | None) -> None:
    if tools:
        _bound("tools", len(tools), limits.max_tools)
        size = len(orjson.dumps(tools))
        if size > limits.max_tools_bytes:
            raise InvalidRequest(f"the tool definitions take {size} bytes; this gateway allows at most "
                                 f"{limits.max_tools_bytes}", param="tools")


# Keys whose strings are not text the model reads: ids, names of roles and types, and images (bounded apart).
_NOT_TEXT = frozenset({"type", "role", "id", "call_id", "name", "status", "image_url", "source", "file_id", "cache_control"})


def _text_size(value) -> int:
    """Characters of text in a Responses input or in Anthropic messages: every string but ids, types and images."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(_text_size(v) for v in value)
    if isinstance(value, dict):
        return sum(_text_size(v) for k, v in value.items() if k not in _NOT_TEXT)
    return 0


def _check_agent_bounds(limits: GatewaySettings, request: ResponsesRequest | MessagesRequest | CountTokensRequest) -> None:
    """The Responses and Messages APIs (and count_tokens) bounded as chat is: length, prompt size, messages, images and
    tools."""
    if isinstance(request, ResponsesRequest):
        _bound("max_output_tokens", request.max_output_tokens, limits.max_tokens)
        items, field = ([] if isinstance(request.input, str) else request.input), "input"
        size = _text_size(request.input) + len(request.instructions or "")
    else:
        if isinstance(request, MessagesRequest):  # count_tokens asks for no length
            _bound("max_tokens", request.max_tokens, limits.max_tokens)
            _check_stops(limits, request.stop_sequences or [], "stop_sequences")
        items, field = request.messages, "messages"
        size = _text_size(request.messages) + _text_size(request.system)
    if size > limits.max_prompt_chars:
        raise InvalidRequest(f"the prompt has {size} characters; this gateway allows at most {limits.max_prompt_chars}",
                             param=field)
    if len(items) > limits.max_messages:
        raise InvalidRequest(f"{len(items)} {field} items; this gateway allows at most {limits.max_messages}",
                             param=field)
    check_chat_images(limits, [i for i in items if isinstance(i, dict)], field)
    _check_tools(limits, request.tools)


# What vLLM generates for a completion that names no max_tokens (OpenAI's default too).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def _bound_omitted_length(limits: GatewaySettings, request: ChatCompletionRequest | CompletionRequest,
                          body: dict) -> None:
    """A request that names no length gets the gateway's bound sent explicitly: left out, vLLM would generate up to
    the rest of the context window (chat), past `max_tokens`. vLLM still stops at the end of the context."""
    if isinstance(request, CompletionRequest):
        if request.max_tokens is None:
            body["max_tokens"] = min(COMPLETIONS_DEFAULT_MAX_TOKENS, limits.max_tokens)
    elif request.max_tokens is None and request.max_completion_tokens is None:
        body["max_completion_tokens"] = limits.max_tokens


def conversation(request: ChatCompletionRequest | CompletionRequest, user: str | None, session: str | None) -> str:
    """What marks one conversation for cache-aware routing (prefix.py): the client's x-session-id, else its `user`, else its
    start (a chat's first two messages, the system prompt and the first question, which every later turn repeats; a
    completion's first 1,024 characters)."""
    if session:
        return f"session:{session}"
    if user:
        return f"user:{user}"
    if isinstance(request, ChatCompletionRequest):
        return "chat:" + hashlib.blake2b(orjson.dumps(request.messages[:2], default=str), digest_size=16).hexdigest()
    prompt = request.prompt if isinstance(request.prompt, str) else orjson.dumps(request.prompt, default=str).decode()
    return "prompt:" + hashlib.blake2b(prompt[:1024].encode(), digest_size=16).hexdigest()


async def generate(state: GatewayState, path: str, request: ChatCompletionRequest | CompletionRequest,
                   key: ApiKey | None = None, session: str | None = None):
    """Non-streamed: the backend's JSON answer. Streamed: its relay (_Relay), which an EventStream sends. `session`:
    the request's x-session-id header."""
    _check_bounds(state.settings, request)
    user = (request.model_extra or {}).get("user")
    user = user if isinstance(user, str) else None
    info = await state.dispatch.resolve(request.model, TASK, key.name if key else None, user)
    body = request.model_dump(exclude_unset=True)  # as sent, extras included: vLLM judges what we do not bound
    _bound_omitted_length(state.settings, request, body)
    if state.settings.vllm_priority and key is not None:  # vLLM's own queue orders by it too: lower first
        asked = body.get("priority")
        body["priority"] = max(asked, key.priority) if isinstance(asked, int) else key.priority
    affinity = None
    routed = state.settings.affinity and state.dispatch.replicated(info.name)  # routing by prefix has a choice to make
    if routed or TRACE.get() is not None:  # cache-aware routing (prefix.py); the trace's hash_ids
        text = prompt_text(request.messages if isinstance(request, ChatCompletionRequest) else None,
                           getattr(request, "prompt", None))
        length = body.get("max_completion_tokens") or body.get("max_tokens") or state.settings.max_tokens
        prefix = prefix_of(text, conversation(request, user, session), state.settings.prefix_block_chars,
                           int(length) if isinstance(length, int) else state.settings.max_tokens)
        note(hash_ids=hash_ids(prefix.blocks))
        affinity = prefix if routed else None
    if not request.stream:
        answer = await state.dispatch.call(info, lambda b, m: b.generate(path, body, m.name), affinity)
        await count_usage(state, key, info.name, answer.get("usage"))
        return answer
    client_wants_usage = bool((request.stream_options or {}).get("include_usage"))
    body["stream_options"] = {**(request.stream_options or {}), "include_usage": True}
    stream = await state.dispatch.call(info, lambda b, m: b.open_stream(path, body, m.name), affinity)
    return _Relay(stream, info.name, client_wants_usage, lambda usage: count_usage(state, key, info.name, usage))


async def relay_agent_api(state: GatewayState, path: str, request: ResponsesRequest | MessagesRequest,
                          key: ApiKey | None = None):
    """/v1/responses or /v1/messages: bounded, relayed, counted. Non-streamed: vLLM's JSON answer; streamed: an
    relay of its SSE events (_Relay), the usage event included."""
    _check_agent_bounds(state.settings, request)
    info = await state.dispatch.resolve(request.model, TASK)
    body = request.model_dump(exclude_unset=True)
    if isinstance(request, ResponsesRequest) and request.max_output_tokens is None:
        # Left out, vLLM would generate to the end of the context. It refuses a length over the model's context (and
        # stops at the context's end within it): the gateway's bound, or the context, whichever is smaller.
        body["max_output_tokens"] = min(state.settings.max_tokens, info.extra.get("max_model_len") or sys.maxsize)
    if not request.stream:
        answer = await state.dispatch.call(info, lambda b, m: b.generate(path, body, m.name))
        await count_usage(state, key, info.name, answer.get("usage"))
        return answer
    stream = await state.dispatch.call(info, lambda b, m: b.open_stream(path, body, m.name))
    return _Relay(stream, info.name, True, lambda usage: count_usage(state, key, info.name, usage),
                  end=b"", error_event=_typed_error_event)


async def count_tokens(state: GatewayState, request: CountTokensRequest) -> dict:
    """Anthropic's /v1/messages/count_tokens, bounded as a Messages prompt is, relayed (nothing generated: no usage)."""
    _check_agent_bounds(state.settings, request)
    info = await state.dispatch.resolve(request.model, TASK)
    body = request.model_dump(exclude_unset=True)
    return await state.dispatch.call(info, lambda b, m: b.generate("/v1/messages/count_tokens", body, m.name))


async def tokenize(state: GatewayState, path: str, request: TokenizeRequest | DetokenizeRequest) -> dict:
    """vLLM's /tokenize or /detokenize, bounded as a prompt is (a token id counts one character), relayed."""
    limits = state.settings
    if isinstance(request, DetokenizeRequest):
        size, field = len(request.tokens), "tokens"
    else:
        if request.messages is not None and len(request.messages) > limits.max_messages:
            raise InvalidRequest(f"{len(request.messages)} messages; this gateway allows at most {limits.max_messages}",
                                 param="messages")
        size = len(request.prompt or "") + messages_size(request.messages or [])
        field = "prompt" if request.prompt is not None else "messages"
    if size > limits.max_prompt_chars:
        raise InvalidRequest(f"the {field} has {size} {'tokens' if field == 'tokens' else 'characters'}; this gateway "
                             f"allows at most {limits.max_prompt_chars}", param=field)
    info = await state.dispatch.resolve(request.model, TASK)
    body = request.model_dump(exclude_unset=True)
    return await state.dispatch.call(info, lambda b, m: b.generate(path, body, m.name))


def _error_event(message: str) -> bytes:
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": "backend_stream_error"}}
    return b"data: " + orjson.dumps(body) + b"\n\n"


def _typed_error_event(message: str) -> bytes:
    """The error event of the Responses and Messages streams: Anthropic's shape, which the openai SDK raises on too."""
    body = {"type": "error", "error": {"type": "api_error", "message": message, "code": "backend_stream_error"}}
    return b"event: error\ndata: " + orjson.dumps(body) + b"\n\n"


class _Relay:
    """A generation's stream as its client gets it (edge/event_stream.py sends it): the chunks as they come, the
    usage counted and sent only where the client asked for it, an error event where the backend's stream broke, and
    the end marker."""

    def __init__(self, stream: Stream, model: str, client_wants_usage: bool, count_usage,
                 end: bytes = b"data: [DONE]\n\n", error_event=_error_event):
        self.stream, self.model, self.client_wants_usage, self.count_usage = stream, model, client_wants_usage, count_usage
        self.end, self.error_event = end, error_event
        self._closed = False

    async def pump(self, send: Callable[[bytes], Awaitable[None]]) -> None:
        first = True

        async def deliver(raw: bytes, usage: dict | None) -> None:
            nonlocal first
            if first:
                first = False
                self.stream.first_chunk()
                note_first_chunk()
            if usage is not None:
                # The final usage chunk. (With continuous_usage_stats every chunk carries running totals:
                # counting those would count each token many times.)
                await self.count_usage(usage)
                if not self.client_wants_usage:
                    return
            await send(raw)

        try:
            await self.stream.pump(deliver)
        except StreamBroken as exc:
            log.warning("%s: %s", self.model, exc)
            await send(self.error_event(f"model {self.model} stopped before the answer was complete; the text above "
                                        "is partial"))
            return
        finally:
            await self.aclose()
        if self.end:
            await send(self.end)

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            await self.stream.aclose()


# Deep readiness (state.py): the first request each model answers before it takes traffic (one token).
CANARIES = {TEXT_GENERATION: lambda backend, model, timeout: backend.generate(
    "/v1/completions", {"model": model.name, "prompt": "ok", "max_tokens": 1}, model.name)}
