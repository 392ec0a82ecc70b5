"""Wire models of vLLM's rerank API (`/v1/rerank`; Cohere's `/v2/rerank` and the unversioned `/rerank` take the same
body) and its score API (`/v1/score`, `/score`): relevance scores from a cross-encoder.

As for generation, only what costs is typed here (serving.py bounds it): the texts, how many, and their images. Every
other field (top_n, truncate_prompt_tokens, max_tokens_per_doc, use_activation, instruction, return_documents, ...)
is relayed as sent, and vLLM's own 400 comes back in our error shape.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, StrictStr

from ..inputs.wire import TokenId

# A text, or {"content": [parts]} (text and image parts) for the multimodal rerankers vLLM serves.
ScoreInput = StrictStr | dict
ScoreInputs = ScoreInput | list[ScoreInput]


class RerankRequest(BaseModel):
    """A query and the documents to rank against it (Jina's and Cohere's shape)."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr = Field(min_length=1, max_length=256)
    query: ScoreInput
    documents: ScoreInputs


class ScoreRequest(BaseModel):
    """Scores of text pairs: `queries` with `documents` (or `items`), or the older names `text_1` / `text_2` and
    `data_1` / `data_2`; one side may be a single text, scored against each of the other's."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr = Field(min_length=1, max_length=256)
    queries: ScoreInputs | None = None
    documents: ScoreInputs | None = None
    items: ScoreInputs | None = None
    text_1: ScoreInputs | None = None
    text_2: ScoreInputs | None = None
    data_1: ScoreInputs | None = None
    data_2: ScoreInputs | None = None


class PoolingRequest(BaseModel):
    """vLLM's /pooling (the model's hidden states, pooled) and /classify (a sequence classifier's labels) on a pooling
    engine: texts or token ids as `input`, or a chat as `messages`."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr = Field(min_length=1, max_length=256)
    input: StrictStr | list[StrictStr] | list[TokenId] | list[list[TokenId]] | None = None
    messages: list[dict] | None = None
