from fastapi import Depends, Request

from ..access.auth import admit, authenticate
from ..edge.hotpath import HotRoute
from ..edge.orjson_route import gateway_router
from .protocol import ClassifyRequest, ClassifyResponse
from .serving import classify

router = gateway_router(dependencies=[Depends(authenticate)])
# Served by the lean handler (hotpath.py); the route below documents it and takes bodies not sent as JSON.
HOT = HotRoute("/v1/classify", ClassifyRequest, classify)


@router.post(HOT.path, response_model=ClassifyResponse, tags=["tasks"])
async def classify_route(body: ClassifyRequest, request: Request) -> ClassifyResponse:
    """Classify one text or a list of texts with a text-classification model."""
    await admit(request, body.model)
    return await classify(request.app.state.gateway, body)
