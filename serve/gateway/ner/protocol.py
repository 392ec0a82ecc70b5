"""Wire models of POST /v1/ner (token classification)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from ..inputs.text import TextInputRequest
from ..inputs.wire import Text, Texts

Aggregation = Literal["none", "simple", "first", "average", "max"]


class NerRequest(TextInputRequest):
    """Texts to tag. `aggregation` works as in transformers' token-classification pipeline: none gives one
    entry per token, simple groups adjacent tokens of one type, first / average / max first decide one
    label per whole word (by its first sub-word, the mean of its sub-words' scores, or the most confident
    sub-word) and then group. Left out: the model's default (set at export)."""

    input: Text | Texts = Field(description="one text, or a list of texts")
    aggregation: Aggregation | None = None


class Entity(BaseModel):
    entity: str = Field(description="the label (aggregation none) or the entity type, B-/I- prefix removed")
    score: float
    start: int = Field(description="character offset of the span's first character in the text")
    end: int = Field(description="character offset just after the span")
    word: str = Field(description="text[start:end]")
    index: int | None = Field(None, description="token position (aggregation none only)")


class NerResult(BaseModel):
    index: int
    entities: list[Entity]
    truncated: bool = Field(description="the text was longer than the model's maximum length; its tail was not tagged")
    tokens: int


class NerResponse(BaseModel):
    object: Literal["list"] = "list"
    model: str
    aggregation: str
    data: list[NerResult]
