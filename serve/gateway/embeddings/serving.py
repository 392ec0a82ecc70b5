"""POST /v1/embeddings logic, testable without a server."""

from __future__ import annotations

import base64

import numpy as np

from core.contract import FEATURE_EXTRACTION

from .. import metrics
from ..exceptions import InvalidRequest
from ..fleet.answer_cache import Rows
from ..inputs.text import check_texts
from ..state import GatewayState
from .protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage

TASK = FEATURE_EXTRACTION


def _check_texts(state: GatewayState, request: EmbeddingRequest) -> list[str]:
    if request.token_arrays():
        raise InvalidRequest("token arrays are not supported; send text", param="input")
    return check_texts(state.settings, request.input)


def _check_dimensions(request: EmbeddingRequest, model: str, size: int) -> None:
    """We cannot shorten vectors (that needs a model trained for it), so only the model's own size passes."""
    if request.dimensions is not None and size and request.dimensions != size:
        raise InvalidRequest(
            f"model {model!r} makes vectors of {size} dimensions; dimensions must be {size} or left out",
            param="dimensions",
        )


def _encode(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4", copy=False).tobytes()).decode("ascii")
    return vector.tolist()


async def embed(state: GatewayState, request: EmbeddingRequest) -> EmbeddingResponse:
    texts = _check_texts(state, request)
    info = await state.dispatch.resolve(request.model, TASK)
    _check_dimensions(request, info.name, info.dimensions)  # before the backend call when the size is known
    results = await state.dispatch.call(info, Rows(("embed",), texts, lambda b, m, texts:
                                                   b.embed(m, texts, state.settings.request_timeout_s)))
    _check_dimensions(request, info.name, results[0].vector.size)  # models that did not declare their size
    tokens = sum(r.tokens for r in results)
    metrics.TOKENS.labels(info.name, "prompt").inc(tokens)
    data = [EmbeddingData(index=i, embedding=_encode(r.vector, request.encoding_format)) for i, r in enumerate(results)]
    return EmbeddingResponse(
        data=data,
        model=info.name,
        usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
    )


# Deep readiness (state.py): the first request each model answers before it takes traffic.
CANARIES = {FEATURE_EXTRACTION: lambda backend, model, timeout: backend.embed(model, ["ok"], timeout)}
