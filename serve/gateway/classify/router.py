from fastapi import Request

from ..routing import gateway_router

from .protocol import ClassifyRequest, ClassifyResponse
from .serving import classify

router = gateway_router()


@router.post("/v1/classify", response_model=ClassifyResponse, tags=["tasks"])
async def classify_route(body: ClassifyRequest, request: Request) -> ClassifyResponse:
    """Classify one text or a list of texts with a text-classification model."""
    request.state.model = body.model if body.model in request.app.state.gateway.models else ""
    return await classify(request.app.state.gateway, body)
