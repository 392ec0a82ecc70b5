from fastapi import Depends, Request

from ..access.auth import admit, authenticate
from ..edge.orjson_route import gateway_router
from .protocol import ImageGenerationRequest, ImageGenerationResponse
from .serving import generate_images

router = gateway_router(dependencies=[Depends(authenticate)])


@router.post("/v1/images/generations", response_model=ImageGenerationResponse, tags=["openai"])
async def images_generations(body: ImageGenerationRequest, request: Request) -> ImageGenerationResponse:
    """OpenAI image generation from a text-to-image (diffusion) model: PNGs as base64."""
    await admit(request, body.model)
    return await generate_images(request.app.state.gateway, body)
