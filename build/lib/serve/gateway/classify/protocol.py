"""Wire models of POST /v1/classify."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr, field_validator

from ..wire import Text, Texts


class TextInputRequest(BaseModel):
    """A request on `model` whose `input` is one string or a list of them (made a list here); no
    unknown fields, no empty list, no blank text. Subclasses declare `input`'s type."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr = Field(min_length=1, max_length=256)

    # Empty inputs are declared in the schema (Texts) and refused here first, in plain words.
    @field_validator("input", mode="before", check_fields=False)
    @classmethod
    def _one_or_many(cls, value):
        items = [value] if isinstance(value, (str, dict)) else value
        if isinstance(items, list):
            if not items:
                raise ValueError("must hold at least one text")
            for i, item in enumerate(items):
                if isinstance(item, str) and not item.strip():
                    raise ValueError(f"text {i} is empty")
        return items


class ImageInput(BaseModel):
    """One image for an image-classification model: the PNG or JPEG file's bytes, base64-encoded
    (a `data:image/...;base64,` URL is accepted too)."""

    model_config = ConfigDict(extra="forbid")

    image: StrictStr = Field(min_length=1)


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
