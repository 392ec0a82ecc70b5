import orjson
from fastapi import Depends, Request, Response
from fastapi.responses import StreamingResponse

from ..auth import admit, authenticate, request_key
from ..routing import gateway_router
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .serving import generate, tokenize

router = gateway_router(tags=["openai"], dependencies=[Depends(authenticate)])


async def _answer(request: Request, path: str, body):
    await admit(request, body.model)
    result = await generate(request.app.state.gateway, path, body, request_key(request))
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
