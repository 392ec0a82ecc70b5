"""POST /v1/images/generations logic, testable without a server."""

from __future__ import annotations

import base64
import json
import secrets
import time

from core.contract import TEXT_TO_IMAGE

from ..backends.base import ModelInfo
from ..exceptions import InvalidRequest
from ..state import GatewayState
from .protocol import ImageData, ImageGenerationRequest, ImageGenerationResponse

TASK = TEXT_TO_IMAGE


def generation_parameters(state: GatewayState, request: ImageGenerationRequest, defaults: dict) -> dict:
    """The request's parameters with the model's defaults, each within the gateway's bounds (400 naming the
    limit otherwise), before Triton sees them."""
    limits = state.settings
    if request.response_format == "url":
        raise InvalidRequest("response_format url is not served: the gateway keeps no images to link to; use b64_json",
                             param="response_format")
    for field, text in (("prompt", request.prompt), ("negative_prompt", request.negative_prompt or "")):
        if len(text) > limits.max_image_prompt_chars:  # the text encoder takes 77 tokens; past this is only work
            raise InvalidRequest(f"the {field} has {len(text)} characters; the limit is {limits.max_image_prompt_chars}",
                                 param=field)
    n = request.n or 1
    if n > limits.max_images:
        raise InvalidRequest(f"n is {n}; the limit is {limits.max_images} images per request", param="n")
    width = height = int(defaults["size"])
    if request.size not in (None, "auto"):
        width, height = (int(v) for v in request.size.split("x"))
    for what, value in (("width", width), ("height", height)):
        if value % 8 or value < 8:
            raise InvalidRequest(f"size {width}x{height}: the {what} must be a positive multiple of 8", param="size")
        if value > limits.max_image_size:
            raise InvalidRequest(f"size {width}x{height}: the {what} is over the limit of {limits.max_image_size} pixels",
                                 param="size")
    if n * width * height > limits.max_image_pixels:  # what one answer holds (and the model's shared memory)
        raise InvalidRequest(f"{n} images of {width}x{height} are {n * width * height} pixels; the limit is "
                             f"{limits.max_image_pixels} per request", param="n")
    steps = request.num_inference_steps or int(defaults["steps"])
    if steps > limits.max_image_steps:
        raise InvalidRequest(f"num_inference_steps is {steps}; the limit is {limits.max_image_steps}",
                             param="num_inference_steps")
    if request.lora_scale is not None and defaults.get("lora_scale") is None:
        raise InvalidRequest("this model has no LoRA: lora_scale does not apply", param="lora_scale")
    if request.lora_scale is not None and defaults.get("lora_fused") and request.lora_scale != defaults["lora_scale"]:
        raise InvalidRequest(f"this model's LoRA is fused into its weights at scale {defaults['lora_scale']:g}; "
                             "lora_scale cannot change it", param="lora_scale")
    return {"prompt": request.prompt, "negative_prompt": request.negative_prompt or "", "steps": steps,
            "guidance": request.guidance_scale if request.guidance_scale is not None else float(defaults["guidance"]),
            "seed": request.seed if request.seed is not None else secrets.randbelow(2**31),
            "width": width, "height": height, "n": n, "scheduler": request.scheduler or "",
            "lora_scale": request.lora_scale if request.lora_scale is not None else -1.0}


async def generate_images(state: GatewayState, request: ImageGenerationRequest) -> ImageGenerationResponse:
    info = await state.dispatch.resolve(request.model, TASK)
    params = generation_parameters(state, request, json.loads(info.extra["defaults"]))
    timeout = state.settings.image_timeout_s
    images, truncated = await state.dispatch.call(info, lambda b, m: b.generate_images(m, params, timeout))
    return ImageGenerationResponse(created=int(time.time()), seed=params["seed"], prompt_truncated_tokens=truncated,
                                   data=[ImageData(b64_json=base64.b64encode(png).decode("ascii")) for png in images])


def canary_request(model: ModelInfo) -> dict:
    """One denoising step of one image at the model's default size and guidance: the shape that an entry whose
    UNet is compiled warmed at load (any other shape would compile again, past the canary's deadline)."""
    defaults = json.loads(model.extra.get("defaults") or "{}")
    size = int(defaults.get("size", 64))
    return {"prompt": "ok", "negative_prompt": "", "steps": 1, "guidance": float(defaults.get("guidance", 7.5)),
            "seed": 0, "width": size, "height": size, "n": 1, "scheduler": "", "lora_scale": -1.0}


# Deep readiness (state.py): the first request each model answers before it takes traffic.
CANARIES = {TEXT_TO_IMAGE: lambda backend, model, timeout: backend.generate_images(model, canary_request(model), timeout)}
