"""Images sent inline to the image routes (classify, detect): the request part, and its decoding within the
deployment's limits."""

from __future__ import annotations

import struct
import zlib

from pydantic import BaseModel, ConfigDict, Field, StrictStr

from ..exceptions import InvalidRequest
from ..settings import GatewaySettings
from . import data_url
from .text import check_count

_MAGIC = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff")  # PNG, JPEG


class ImageInput(BaseModel):
    """One image for an image-classification model: the PNG or JPEG file's bytes, base64-encoded
    (a `data:image/...;base64,` URL is accepted too)."""

    model_config = ConfigDict(extra="forbid")

    image: StrictStr = Field(min_length=1)


def decode_images(limits: GatewaySettings, images: list[ImageInput]) -> list[bytes]:
    """base64 (or data URL) -> the encoded PNG / JPEG bytes, within the deployment's limits."""
    check_count(limits, images, "images")
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


def _png_1x1() -> bytes:
    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00\xff\xff\xff")) + chunk(b"IEND", b""))


CANARY_IMAGE = _png_1x1()  # one white pixel
