import orjson
from fastapi import Depends, Request, Response

from ..access.auth import admit, authenticate, request_key
from ..access.keys import ApiKey
from ..edge.event_stream import EventStream
from ..edge.hotpath import HotRoute
from ..edge.orjson_route import gateway_router
from .protocol import (ChatCompletionRequest, CompletionRequest, CountTokensRequest, DetokenizeRequest, MessagesRequest,
                       ResponsesRequest, TokenizeRequest)
from .serving import count_tokens, generate, relay_agent_api, tokenize

router = gateway_router(tags=["openai"], dependencies=[Depends(authenticate)])


async def answer(state, path: str, body: ChatCompletionRequest | CompletionRequest, key: ApiKey | None,
                 session: str | None) -> Response:
    """A completion, admitted: vLLM's answer relayed as is, or its stream. `session`: the x-session-id header."""
    result = await generate(state, path, body, key, session)
    if body.stream:
        return EventStream(result)
    return Response(orjson.dumps(result), media_type="application/json")


async def _answer(request: Request, path: str, body):
    await admit(request, body.model)
    return await answer(request.app.state.gateway, path, body, request_key(request), request.headers.get("x-session-id"))


def _hot(path: str, request: type[ChatCompletionRequest | CompletionRequest]) -> HotRoute:
    async def hot_answer(state, body, key: ApiKey | None, headers: dict[bytes, bytes]) -> Response:
        return await answer(state, path, body, key, headers[b"x-session-id"].decode("latin-1")
                            if b"x-session-id" in headers else None)

    return HotRoute(path, request, answer=hot_answer)


HOT = [_hot("/v1/chat/completions", ChatCompletionRequest), _hot("/v1/completions", CompletionRequest)]


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    """OpenAI chat completions (streamed with `stream: true`), for a base model or a LoRA adapter."""
    return await _answer(request, "/v1/chat/completions", body)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    """OpenAI text completions (streamed with `stream: true`)."""
    return await _answer(request, "/v1/completions", body)


async def _relay_agent_api(request: Request, path: str, body: ResponsesRequest | MessagesRequest):
    await admit(request, body.model)
    result = await relay_agent_api(request.app.state.gateway, path, body, request_key(request))
    if body.stream:
        return EventStream(result)
    return Response(orjson.dumps(result), media_type="application/json")


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request):
    """OpenAI's Responses API (the `openai` SDK's `responses.create`, streamed with `stream: true`), stateless: vLLM
    keeps no responses for `previous_response_id` unless it is started to store them."""
    return await _relay_agent_api(request, "/v1/responses", body)


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request):
    """Anthropic's Messages API (the `anthropic` SDK's `messages.create`, streamed with `stream: true`); the key may
    come as `x-api-key`, as Anthropic's clients send it, or as a Bearer token."""
    return await _relay_agent_api(request, "/v1/messages", body)


@router.post("/v1/messages/count_tokens")
async def messages_count_tokens(body: CountTokensRequest, request: Request):
    """Anthropic's token count of a Messages prompt (the `anthropic` SDK's `messages.count_tokens`)."""
    await admit(request, body.model)
    return Response(orjson.dumps(await count_tokens(request.app.state.gateway, body)), media_type="application/json")


@router.post("/tokenize")
async def tokenize_route(body: TokenizeRequest, request: Request):
    """vLLM's /tokenize: a prompt's or chat's token ids (with the model's chat template), for a model or an adapter."""
    await admit(request, body.model)
    return Response(orjson.dumps(await tokenize(request.app.state.gateway, "/tokenize", body)),
                    media_type="application/json")


@router.post("/detokenize")
async def detokenize_route(body: DetokenizeRequest, request: Request):
    """vLLM's /detokenize: token ids back to text."""
    await admit(request, body.model)
    return Response(orjson.dumps(await tokenize(request.app.state.gateway, "/detokenize", body)),
                    media_type="application/json")
