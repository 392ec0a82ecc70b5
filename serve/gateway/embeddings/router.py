from fastapi import Depends, Request

from ..access.auth import admit, authenticate
from ..edge.hotpath import HotRoute
from ..edge.orjson_route import gateway_router
from .protocol import EmbeddingRequest, EmbeddingResponse
from .serving import embed

router = gateway_router(dependencies=[Depends(authenticate)])
# Served by the lean handler (hotpath.py); the route below documents it and takes bodies not sent as JSON.
HOT = HotRoute("/v1/embeddings", EmbeddingRequest, embed)


@router.post(HOT.path, response_model=EmbeddingResponse, tags=["openai"])
async def embeddings(body: EmbeddingRequest, request: Request) -> EmbeddingResponse:
    """OpenAI embeddings: one vector per text, as floats or base64 float32, from a feature-extraction model."""
    await admit(request, body.model)
    return await embed(request.app.state.gateway, body)
