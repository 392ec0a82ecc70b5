from fastapi import Depends, Request

from ..auth import admit, authenticate
from ..routing import gateway_router
from .protocol import EmbeddingRequest, EmbeddingResponse
from .serving import embed

router = gateway_router(dependencies=[Depends(authenticate)])


@router.post("/v1/embeddings", response_model=EmbeddingResponse, tags=["openai"])
async def embeddings(body: EmbeddingRequest, request: Request) -> EmbeddingResponse:
    """OpenAI embeddings: one vector per text, as floats or base64 float32, from a feature-extraction model."""
    await admit(request, body.model)
    return await embed(request.app.state.gateway, body)
