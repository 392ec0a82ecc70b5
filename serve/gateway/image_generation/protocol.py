"""Wire models of POST /v1/images/generations, in OpenAI's shape so that the `openai` SDK's
`images.generate` works unchanged; the diffusion knobs OpenAI has no name for are extra fields
(`extra_body` in the SDK): negative_prompt, num_inference_steps, guidance_scale, seed, scheduler, lora_scale."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr

from core.contract import SCHEDULERS

from ..inputs.wire import SafeInt


class ImageGenerationRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: StrictStr = Field(min_length=1, max_length=256)
    prompt: StrictStr = Field(min_length=1, description="what to draw; longer than the text encoder takes: "
                              "truncated, as the pipeline does, and said in the response")
    n: SafeInt | None = Field(None, ge=1, description="images to make (default 1; at most the gateway's max_images)")
    size: StrictStr | None = Field(None, pattern=r"^(\d{1,5}x\d{1,5}|auto)$", description='"WIDTHxHEIGHT", e.g. '
                                   '"512x512", multiples of 8; "auto" or none: the model\'s')
    response_format: Literal["b64_json", "url"] | None = Field(None, description="b64_json (the default here): the "
                                                               "gateway keeps no images to link to")
    output_format: Literal["png"] | None = None
    stream: Literal[False] | None = None
    # OpenAI's other fields, accepted for compatibility and not used
    quality: StrictStr | None = Field(None, max_length=32)
    style: StrictStr | None = Field(None, max_length=32)
    background: StrictStr | None = Field(None, max_length=32)
    moderation: StrictStr | None = Field(None, max_length=32)
    output_compression: SafeInt | None = Field(None, ge=0, le=100)
    partial_images: SafeInt | None = Field(None, ge=0, le=0)
    user: StrictStr | None = Field(None, max_length=256)
    safety_identifier: StrictStr | None = Field(None, max_length=256)
    negative_prompt: StrictStr | None = None
    num_inference_steps: SafeInt | None = Field(None, ge=1, description="default: the model's (set at export)")
    guidance_scale: float | None = Field(None, ge=0, le=50)
    seed: SafeInt | None = Field(None, ge=0, le=2**53 - 1, description="the same seed and parameters give the same "
                                 "image; default: a random one, returned in the response")
    scheduler: Literal[tuple(SCHEDULERS)] | None = None  # type: ignore[valid-type]
    lora_scale: float | None = Field(None, ge=0, le=4, description="strength of the model's LoRA (default: the export's)")


class ImageData(BaseModel):
    b64_json: str
    revised_prompt: str | None = None


class ImageGenerationResponse(BaseModel):
    created: int
    data: list[ImageData]
    seed: int = Field(description="the seed used: send it again to get the same images")
    prompt_truncated_tokens: int = Field(0, description="tokens of the prompt the text encoder could not take")
