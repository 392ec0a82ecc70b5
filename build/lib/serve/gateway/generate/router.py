import orjson
from fastapi import Depends, Request, Response
from fastapi.responses import StreamingResponse

from ..auth import admit, authenticate, request_key
from ..routing import gateway_router
from .protocol import ChatCompletionRequest, CompletionRequest
from .serving import generate

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
