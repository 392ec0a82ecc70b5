"""POST /v1/classify logic, testable without a server."""

from __future__ import annotations

import struct
import zlib

from core.contract import IMAGE_CLASSIFICATION, TEXT_CLASSIFICATION

from .. import data_url
from ..exceptions import InvalidRequest
from ..state import GatewayState
from ..text_input import check_count, check_texts
from .protocol import ClassifyRequest, ClassifyResponse, ClassifyResult, ImageInput

TASK, IMAGE_TASK = TEXT_CLASSIFICATION, IMAGE_CLASSIFICATION
_MAGIC = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff")  # PNG, JPEG


def decode_images(state: GatewayState, images: list[ImageInput]) -> list[bytes]:
    """base64 (or data URL) -> the encoded PNG / JPEG bytes, within the deployment's limits."""
    limits = state.settings
    check_count(state, images, "images")
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


def _png_1x1() -> bytes:
    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00\xff\xff\xff")) + chunk(b"IEND", b""))


CANARY_IMAGE = _png_1x1()  # one white pixel
# Deep readiness (state.py): the first request each model answers before it takes traffic.
CANARIES = {
    TASK: lambda backend, model, timeout: backend.classify(model, ["ok"], timeout),
    IMAGE_TASK: lambda backend, model, timeout: backend.classify_images(model, [CANARY_IMAGE], timeout),
}
