import orjson
from fastapi import Depends, Request, Response
from fastapi.responses import StreamingResponse

from ..access.auth import admit, authenticate, request_key
from ..edge.orjson_route import gateway_router
from .protocol import (ChatCompletionRequest, CompletionRequest, CountTokensRequest, DetokenizeRequest, MessagesRequest,
                       ResponsesRequest, TokenizeRequest)
from .serving import count_tokens, generate, relay_agent_api, tokenize

router = gateway_router(tags=["openai"], dependencies=[Depends(authenticate)])


async def _answer(request: Request, path: str, body):
    await admit(request, body.model)
    result = await generate(request.app.state.gateway, path, body, request_key(request),
                            request.headers.get("x-session-id"))
    if body.stream:
        return StreamingResponse(result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return Response(orjson.dumps(result), media_type="application/json")  # vLLM's answer, relayed as is


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
        return StreamingResponse(result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
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
