"""Images sent inline, one rule set for every route that takes them (classify's images, chat's image parts): a
`data:image/<type>;base64,<payload>` URL (classify also takes the bare payload), the payload strict base64 (the
alphabet, `=` padding only at the end, a length that is a multiple of 4: what vLLM's b64decode(validate=True)
takes), and its decoded size, known from its length before anything is decoded, within max_image_bytes.
ValueError says what is wrong; each route names where."""

from __future__ import annotations

import base64
import re

_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")


def payload(url: str, *, bare_allowed: bool = False) -> str:
    """The base64 payload of a data URL (or of `url` itself when it is no data URL and `bare_allowed`)."""
    if url[:5].lower() != "data:":
        if bare_allowed:
            return url
        raise ValueError("not a data URL")
    header, comma, data = url[5:].partition(",")
    header = header.lower()
    if not comma or not header.startswith("image/") or not header.endswith(";base64"):
        raise ValueError("a data URL must read data:image/<type>;base64,<data>")
    return data


def decoded_size(data: str, max_bytes: int) -> int:
    """The bytes `data` decodes to, checked without decoding: strict base64 within `max_bytes`."""
    if len(data) % 4:
        raise ValueError("the image is not valid base64 (its length is not a multiple of 4)")
    size = len(data) // 4 * 3 - (2 if data.endswith("==") else 1 if data.endswith("=") else 0)
    if size > max_bytes:
        raise ValueError(f"the image has {size} bytes; this gateway allows at most {max_bytes} per image")
    if not _BASE64.fullmatch(data):
        raise ValueError("the image is not valid base64 (A-Z, a-z, 0-9, +, / and = padding only)")
    return size


def decode(data: str, max_bytes: int) -> bytes:
    decoded_size(data, max_bytes)
    return base64.b64decode(data, validate=True)
