from fastapi import Request

from ..routing import gateway_router

from .protocol import NerRequest, NerResponse
from .serving import tag

router = gateway_router()


@router.post("/v1/ner", response_model=NerResponse, response_model_exclude_none=True, tags=["tasks"])
async def ner_route(body: NerRequest, request: Request) -> NerResponse:
    """Tag entities (token classification) in one text or a list of texts, with character offsets."""
    request.state.model = body.model if body.model in request.app.state.gateway.models else ""
    return await tag(request.app.state.gateway, body)
