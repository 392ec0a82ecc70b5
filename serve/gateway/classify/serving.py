"""POST /v1/classify logic, testable without a server."""

from __future__ import annotations

from ...exceptions import InvalidRequest
from ..state import GatewayState
from .protocol import ClassifyRequest, ClassifyResponse, ClassifyResult

TASK = "text-classification"


def check_texts(state: GatewayState, texts: list[str]) -> list[str]:
    """The deployment's limits on texts per request and characters per text (shared by text endpoints)."""
    limits = state.settings
    if len(texts) > limits.max_inputs:
        raise InvalidRequest(f"at most {limits.max_inputs} texts per request, got {len(texts)}", param="input")
    for i, text in enumerate(texts):
        if len(text) > limits.max_input_chars:
            raise InvalidRequest(
                f"text {i} has {len(text)} characters; the limit is {limits.max_input_chars}", param="input"
            )
    return texts


async def classify(state: GatewayState, request: ClassifyRequest) -> ClassifyResponse:
    texts = check_texts(state, request.input)  # the validator made it a list
    limits = state.settings
    info, backend = state.resolve(request.model, TASK)
    results = await backend.classify(info, texts, limits.request_timeout_s)
    return ClassifyResponse(
        model=info.name,
        data=[ClassifyResult(index=i, label=r.label, score=r.score, scores=r.scores) for i, r in enumerate(results)],
    )
