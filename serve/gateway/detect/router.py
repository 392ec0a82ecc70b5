from fastapi import Depends, Request

from ..access.auth import admit, authenticate
from ..edge.orjson_route import gateway_router
from .protocol import DetectRequest, DetectResponse
from .serving import detect

router = gateway_router(dependencies=[Depends(authenticate)])


@router.post("/v1/detect", response_model=DetectResponse, tags=["tasks"])
async def detect_route(body: DetectRequest, request: Request) -> DetectResponse:
    """Detect objects in images with an object-detection model: boxes, scores and labels per image."""
    await admit(request, body.model)
    return await detect(request.app.state.gateway, body)
