from fastapi import Request

from ..routing import gateway_router

from .protocol import EmbeddingRequest, EmbeddingResponse
from .serving import embed

router = gateway_router()


@router.post("/v1/embeddings", response_model=EmbeddingResponse, tags=["openai"])
async def embeddings(body: EmbeddingRequest, request: Request) -> EmbeddingResponse:
    """OpenAI embeddings: one vector per text, as floats or base64 float32, from a feature-extraction model."""
    request.state.model = body.model if body.model in request.app.state.gateway.models else ""
    return await embed(request.app.state.gateway, body)
