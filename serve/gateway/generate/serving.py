"""Generation through vLLM: bounds checked here, then the request is relayed (streamed or not).

A stream that breaks after it started ends with a terminal SSE error event and no [DONE], so that a
client can never take a cut answer for a whole one. Token usage is counted in metrics; vLLM is always
asked for usage on streams, and that chunk is passed on only if the client asked for it too.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

import httpx

from ...exceptions import InvalidRequest
from .. import metrics
from ..state import GatewayState
from .protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("rtxserve.gateway")
TASK = "text-generation"


def _check_bounds(state: GatewayState, request: ChatCompletionRequest | CompletionRequest) -> None:
    limits = state.settings
    for field in ("max_tokens", "max_completion_tokens"):
        value = getattr(request, field, None)
        if value is not None and value > limits.max_tokens:
            raise InvalidRequest(f"{field} is {value}; this gateway allows at most {limits.max_tokens}", param=field)
    if request.n is not None and request.n > limits.max_n:
        raise InvalidRequest(f"n is {request.n}; this gateway allows at most {limits.max_n}", param="n")
    stops = request.stop_list()
    if len(stops) > limits.max_stop or any(len(s) > 256 or not s for s in stops):
        raise InvalidRequest(f"at most {limits.max_stop} stop sequences of 1 to 256 characters", param="stop")
    if isinstance(request, ChatCompletionRequest) and len(request.messages) > limits.max_messages:
        raise InvalidRequest(f"at most {limits.max_messages} messages", param="messages")


def _count_usage(model: str, usage: dict | None) -> None:
    if usage:
        metrics.TOKENS.labels(model, "prompt").inc(usage.get("prompt_tokens") or 0)
        metrics.TOKENS.labels(model, "completion").inc(usage.get("completion_tokens") or 0)


async def generate(state: GatewayState, path: str, request: ChatCompletionRequest | CompletionRequest):
    """Non-streamed: the backend's JSON answer. Streamed: an async iterator of SSE event strings."""
    _check_bounds(state, request)
    info, backend = state.resolve(request.model, TASK)
    body = request.model_dump(exclude_none=True)
    if not request.stream:
        answer = await backend.generate(path, body, info.name)
        _count_usage(info.name, answer.get("usage"))
        return answer
    client_wants_usage = bool(request.stream_options and request.stream_options.include_usage)
    body["stream_options"] = {"include_usage": True}
    response = await backend.open_stream(path, body, info.name)
    return _relay(response, info.name, client_wants_usage)


def _error_event(message: str) -> str:
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": "backend_stream_error"}}
    return f"data: {json.dumps(body)}\n\n"


async def _relay(response: httpx.Response, model: str, client_wants_usage: bool) -> AsyncIterator[str]:
    finished = False
    try:
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                finished = True
                yield "data: [DONE]\n\n"
                break
            try:
                chunk = json.loads(payload)
            except json.JSONDecodeError:
                log.warning("vllm %s: unparsable stream chunk", model)
                break
            if isinstance(chunk, dict) and "error" in chunk:
                log.warning("vllm %s: error in stream: %s", model, str(chunk["error"])[:300])
                break
            if chunk.get("usage"):
                _count_usage(model, chunk["usage"])
                if not chunk.get("choices") and not client_wants_usage:
                    continue
            yield f"data: {payload}\n\n"
    except httpx.HTTPError as exc:
        log.warning("vllm %s: stream broke: %s", model, type(exc).__name__)
    finally:
        await response.aclose()  # also what aborts the generation in vLLM when the client left
    if not finished:
        yield _error_event(f"model {model} stopped before the answer was complete; the text above is partial")
