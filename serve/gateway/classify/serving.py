"""POST /v1/classify logic, testable without a server."""

from __future__ import annotations

from core.contract import IMAGE_CLASSIFICATION, TEXT_CLASSIFICATION

from .. import data_url
from ..exceptions import InvalidRequest
from ..state import GatewayState
from .protocol import ClassifyRequest, ClassifyResponse, ClassifyResult, ImageInput

TASK, IMAGE_TASK = TEXT_CLASSIFICATION, IMAGE_CLASSIFICATION
_MAGIC = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff")  # PNG, JPEG


def _check_count(state: GatewayState, items: list, what: str) -> None:
    if len(items) > state.settings.max_inputs:
        raise InvalidRequest(f"at most {state.settings.max_inputs} {what} per request, got {len(items)}", param="input")


def check_texts(state: GatewayState, texts: list[str]) -> list[str]:
    """The deployment's limits on texts per request and characters per text (shared by text endpoints)."""
    limits = state.settings
    _check_count(state, texts, "texts")
    for i, text in enumerate(texts):
        if len(text) > limits.max_input_chars:
            raise InvalidRequest(
                f"text {i} has {len(text)} characters; the limit is {limits.max_input_chars}", param="input"
            )
    return texts


def decode_images(state: GatewayState, images: list[ImageInput]) -> list[bytes]:
    """base64 (or data URL) -> the encoded PNG / JPEG bytes, within the deployment's limits."""
    limits = state.settings
    _check_count(state, images, "images")
    out = []
    for i, item in enumerate(images):
        try:
            raw = data_url.decode(data_url.payload(item.image, bare_allowed=True), limits.max_image_bytes)
        except ValueError as exc:
            raise InvalidRequest(f"image {i}: {exc}", param="input") from None
        if not raw.startswith(_MAGIC):
            raise InvalidRequest(f"image {i} is not a PNG or JPEG file", param="input")
        out.append(raw)
    return out


async def classify(state: GatewayState, request: ClassifyRequest) -> ClassifyResponse:
    limits = state.settings
    info = state.resolve(request.model, (TASK, IMAGE_TASK))
    images = isinstance(request.input[0], ImageInput)  # the validator made it a list
    if info.task == IMAGE_TASK and not images:
        raise InvalidRequest(f'model {info.name!r} classifies images; send input as [{{"image": "<base64 PNG or JPEG>"}}]',
                             param="input")
    if info.task == TASK and images:
        raise InvalidRequest(f"model {info.name!r} classifies text; send input as a string or a list of strings",
                             param="input")
    if images:
        encoded = decode_images(state, request.input)
        results = await state.call(info, lambda b, m: b.classify_images(m, encoded, limits.request_timeout_s))
    else:
        texts = check_texts(state, request.input)
        results = await state.call(info, lambda b, m: b.classify(m, texts, limits.request_timeout_s))
    return ClassifyResponse(
        model=info.name,
        data=[ClassifyResult(index=i, label=r.label, score=r.score, scores=r.scores) for i, r in enumerate(results)],
    )
