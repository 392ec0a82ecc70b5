"""Wire models of POST /v1/classify."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from ..inputs.images import ImageInput
from ..inputs.text import TextInputRequest
from ..inputs.wire import Text, Texts


class ClassifyRequest(TextInputRequest):
    """Texts (text-classification models) or images (image-classification models) to classify. Texts
    longer than the model's maximum length in tokens are truncated by the tokenizer (as Hugging Face
    pipelines do with truncation=True)."""

    input: Text | Texts | Annotated[list[ImageInput], Field(min_length=1)] = Field(
        description='one text, a list of texts, or images as [{"image": "<base64 PNG/JPEG>"}, ...]')


class ClassifyResult(BaseModel):
    index: int
    label: str
    score: float
    scores: dict[str, float]


class ClassifyResponse(BaseModel):
    object: Literal["list"] = "list"
    model: str
    data: list[ClassifyResult]
