from fastapi import Depends, Request

from ..access.auth import admit, authenticate
from ..edge.hotpath import HotRoute
from ..edge.orjson_route import gateway_router
from .protocol import NerRequest, NerResponse
from .serving import tag

router = gateway_router(dependencies=[Depends(authenticate)])
# Served by the lean handler (hotpath.py); the route below documents it and takes bodies not sent as JSON.
HOT = HotRoute("/v1/ner", NerRequest, tag, exclude_none=True)


@router.post(HOT.path, response_model=NerResponse, response_model_exclude_none=True, tags=["tasks"])
async def ner_route(body: NerRequest, request: Request) -> NerResponse:
    """Tag entities (token classification) in one text or a list of texts, with character offsets."""
    await admit(request, body.model)
    return await tag(request.app.state.gateway, body)
