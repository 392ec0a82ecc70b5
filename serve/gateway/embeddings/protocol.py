"""Wire models of POST /v1/embeddings, in OpenAI's shape so that the `openai` SDK works unchanged."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, StrictStr

from ..inputs.text import TextInputRequest
from ..inputs.wire import SafeInt, Text, Texts, TokenIds


class EmbeddingRequest(TextInputRequest):
    """Texts to embed. Token-id arrays parse here so that serving can refuse them with a clear 400
    (the tokenizer runs inside the Triton ensemble, which takes text); `dimensions` is accepted only
    when it equals the model's size, because vectors are never truncated silently."""

    input: Text | Texts | TokenIds | Annotated[list[TokenIds], Field(min_length=1)] = Field(
        description="one text, or a list of texts")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: the little-endian float32 bytes of each vector (what the openai SDK asks for)"
    )
    dimensions: SafeInt | None = Field(None, ge=1, description="must equal the model's vector size if given")
    user: StrictStr | None = Field(None, max_length=256, description="accepted for compatibility; not used")

    def token_arrays(self) -> bool:
        return not isinstance(self.input[0], str)


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
