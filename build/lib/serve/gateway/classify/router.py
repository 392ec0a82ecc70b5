from fastapi import Depends, Request

from ..auth import admit, authenticate
from ..routing import gateway_router
from .protocol import ClassifyRequest, ClassifyResponse
from .serving import classify

router = gateway_router(dependencies=[Depends(authenticate)])


@router.post("/v1/classify", response_model=ClassifyResponse, tags=["tasks"])
async def classify_route(body: ClassifyRequest, request: Request) -> ClassifyResponse:
    """Classify one text or a list of texts with a text-classification model."""
    await admit(request, body.model)
    return await classify(request.app.state.gateway, body)
