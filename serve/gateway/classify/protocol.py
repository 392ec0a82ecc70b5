"""Wire models of POST /v1/classify."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr, field_validator


class ClassifyRequest(BaseModel):
    """Texts to classify. `input` is one string or a list. Texts longer than the model's maximum
    length in tokens are truncated by the tokenizer (as Hugging Face pipelines do with truncation=True)."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr = Field(min_length=1, max_length=256)
    input: list[StrictStr] = Field(description="one text, or a list of texts")

    @field_validator("input", mode="before")
    @classmethod
    def _one_or_many(cls, value):
        return [value] if isinstance(value, str) else value

    @field_validator("input")
    @classmethod
    def _non_empty(cls, texts: list[str]) -> list[str]:
        if not texts:
            raise ValueError("must hold at least one text")
        for i, text in enumerate(texts):
            if not text.strip():
                raise ValueError(f"text {i} is empty")
        return texts


class ClassifyResult(BaseModel):
    index: int
    label: str
    score: float
    scores: dict[str, float]


class ClassifyResponse(BaseModel):
    object: Literal["list"] = "list"
    model: str
    data: list[ClassifyResult]
