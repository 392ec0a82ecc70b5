"""Rerank and score: bounded here, relayed to the vLLM engine that serves the cross-encoder, usage counted."""

from __future__ import annotations

from core.contract import TEXT_RANKING

from ..access.keys import ApiKey
from ..exceptions import InvalidRequest
from ..inputs.chat import check_chat_images, messages_size
from ..settings import GatewaySettings
from ..state import GatewayState
from ..usage import count_usage
from .protocol import PoolingRequest, RerankRequest, ScoreRequest

TASK = TEXT_RANKING
# The fields of a score request that hold one side of its pairs, by any of vLLM's names for them.
SCORE_SIDES = ("queries", "documents", "items", "text_1", "text_2", "data_1", "data_2")


def _check_side(limits: GatewaySettings, field: str, value: str | dict | list) -> None:
    """At most max_documents texts, each within max_input_chars, their images bounded as a chat's are."""
    items = value if isinstance(value, list) else [value]
    if len(items) > limits.max_documents:
        raise InvalidRequest(f"{len(items)} {field}; this gateway allows at most {limits.max_documents} per request",
                             param=field)
    for i, item in enumerate(items):
        size = messages_size([item if isinstance(item, dict) else {"content": item}])  # a text, or its text parts
        if size > limits.max_input_chars:
            raise InvalidRequest(f"{field}[{i}] has {size} characters; the limit is {limits.max_input_chars}",
                                 param=field)
    check_chat_images(limits, [item if isinstance(item, dict) else {} for item in items], field)


def _check_pooling(limits: GatewaySettings, request: PoolingRequest) -> None:
    """Texts as a side of a score request is; token ids as a prompt's characters (one each); a chat as chat's."""
    value = request.input
    if isinstance(value, list) and value and not isinstance(value[0], str):  # token ids: one list, or one per input
        lists = value if isinstance(value[0], list) else [value]
        if len(lists) > limits.max_documents:
            raise InvalidRequest(f"{len(lists)} inputs; this gateway allows at most {limits.max_documents} per request",
                                 param="input")
        if max(map(len, lists)) > limits.max_prompt_chars:
            raise InvalidRequest(f"an input has {max(map(len, lists))} token ids; this gateway allows at most "
                                 f"{limits.max_prompt_chars}", param="input")
    elif value is not None:
        _check_side(limits, "input", value)
    if request.messages is not None:
        if len(request.messages) > limits.max_messages:
            raise InvalidRequest(f"{len(request.messages)} messages; this gateway allows at most {limits.max_messages}",
                                 param="messages")
        if messages_size(request.messages) > limits.max_prompt_chars:
            raise InvalidRequest(f"the messages have {messages_size(request.messages)} characters; this gateway allows "
                                 f"at most {limits.max_prompt_chars}", param="messages")
        check_chat_images(limits, request.messages, "messages")


async def rank(state: GatewayState, path: str, request: RerankRequest | ScoreRequest | PoolingRequest,
               key: ApiKey | None = None) -> dict:
    """vLLM's answer to /v1/rerank, /v2/rerank, /rerank, /v1/score, /score, /pooling or /classify (its own shape for
    each)."""
    body = request.model_dump(exclude_unset=True)
    if isinstance(request, PoolingRequest):
        _check_pooling(state.settings, request)
    sides = ("query", "documents") if isinstance(request, RerankRequest) else SCORE_SIDES
    for field in sides if not isinstance(request, PoolingRequest) else ():
        if body.get(field) is not None:
            _check_side(state.settings, field, body[field])
    info = await state.dispatch.resolve(request.model, TASK)
    answer = await state.dispatch.call(info, lambda b, m: b.generate(path, body, m.name))
    await count_usage(state, key, info.name, answer.get("usage"))
    return answer


# Deep readiness (state.py): the first request each model answers before it takes traffic.
CANARIES = {TEXT_RANKING: lambda backend, model, timeout: backend.generate(
    "/v1/rerank", {"model": model.name, "query": "ok", "documents": ["ok"]}, model.name)}
