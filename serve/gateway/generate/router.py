from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from .protocol import ChatCompletionRequest, CompletionRequest
from .serving import generate

router = APIRouter(tags=["openai"])


async def _answer(request: Request, path: str, body):
    state = request.app.state.gateway
    request.state.model = body.model if body.model in state.models else ""
    result = await generate(state, path, body)
    if body.stream:
        return StreamingResponse(result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return JSONResponse(result)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    """OpenAI chat completions (streamed with `stream: true`), for a base model or a LoRA adapter."""
    return await _answer(request, "/v1/chat/completions", body)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    """OpenAI text completions (streamed with `stream: true`)."""
    return await _answer(request, "/v1/completions", body)
