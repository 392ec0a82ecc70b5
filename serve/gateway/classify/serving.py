"""POST /v1/classify logic, testable without a server."""

from __future__ import annotations

from core.contract import IMAGE_CLASSIFICATION, TEXT_CLASSIFICATION

from ..exceptions import InvalidRequest
from ..fleet.answer_cache import Rows
from ..inputs.images import CANARY_IMAGE, ImageInput, decode_images
from ..inputs.text import check_texts
from ..state import GatewayState
from .protocol import ClassifyRequest, ClassifyResponse, ClassifyResult

TASK, IMAGE_TASK = TEXT_CLASSIFICATION, IMAGE_CLASSIFICATION


async def classify(state: GatewayState, request: ClassifyRequest) -> ClassifyResponse:
    limits = state.settings
    info = await state.dispatch.resolve(request.model, (TASK, IMAGE_TASK))
    images = isinstance(request.input[0], ImageInput)  # the validator made it a list
    if info.task == IMAGE_TASK and not images:
        raise InvalidRequest(f'model {info.name!r} classifies images; send input as [{{"image": "<base64 PNG or JPEG>"}}]',
                             param="input")
    if info.task == TASK and images:
        raise InvalidRequest(f"model {info.name!r} classifies text; send input as a string or a list of strings",
                             param="input")
    if images:
        encoded = decode_images(state.settings, request.input)
        results = await state.dispatch.call(info, Rows(("classify_images",), encoded, lambda b, m, images:
                                                       b.classify_images(m, images, limits.request_timeout_s)))
    else:
        texts = check_texts(state.settings, request.input)
        results = await state.dispatch.call(info, Rows(("classify",), texts, lambda b, m, texts:
                                                       b.classify(m, texts, limits.request_timeout_s)))
    return ClassifyResponse(
        model=info.name,
        data=[ClassifyResult(index=i, label=r.label, score=r.score, scores=r.scores) for i, r in enumerate(results)],
    )


# Deep readiness (state.py): the first request each model answers before it takes traffic.
CANARIES = {
    TASK: lambda backend, model, timeout: backend.classify(model, ["ok"], timeout),
    IMAGE_TASK: lambda backend, model, timeout: backend.classify_images(model, [CANARY_IMAGE], timeout),
}
