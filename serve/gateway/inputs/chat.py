"""Chat messages as the LLM routes receive them (chat, rerank and score with messages): the size of their text, and
their image parts, bounded before vLLM decodes or fetches them.

vLLM reads OpenAI's `{"type": "image_url", "image_url": {"url": ...}}`, the shorter `{"image_url": "..."}`
without a type (which OpenAI takes too, undocumented), the Responses API's `{"type": "input_image", "image_url":
"..."}` and Anthropic's `{"type": "image", "source": {"type": "base64", "data": ...} or {"type": "url", "url": ...}}`
(a base64 source is held to the data URL's rules). A URL may be a base64 data URL, an http(s) URL that vLLM
fetches from its own network position, or a file: URL under its --allowed-local-media-path: the gateway lets
through data URLs within max_image_bytes and http(s) URLs of the hosts in chat_image_domains, nothing else. Other
part types (text, audio, video, ...) are vLLM's to judge.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from urllib.parse import urlsplit

from ..exceptions import InvalidRequest
from ..settings import GatewaySettings
from . import data_url

# Where URL parsers disagree on the host (userinfo, backslashes, spaces), the host we check may not be the one fetched.
_AMBIGUOUS = re.compile(r"[\x00-\x20\x7f\\]")
_REMOTE = ("remote image URLs are not allowed by this gateway: send the image inline as a data URL "
           "(data:image/png;base64,...), or have the operator allow its host in chat_image_domains "
           "(RTXSERVE_CHAT_IMAGE_DOMAINS)")


def messages_size(messages: list[dict]) -> int:
    """Characters of text in chat messages (their string contents and text parts); images are bounded apart."""
    size = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            size += len(content)
        elif isinstance(content, list):
            size += sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return size


def _image_parts(messages: list[dict], field: str) -> Iterator[tuple[str, dict]]:
    """Each image part of the messages, with where it is (messages[i].content[j], `field` naming the list)."""
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, dict) and (part.get("type") in ("image_url", "input_image", "image")
                                           or (part.get("type") is None and "image_url" in part)):
                yield f"{field}[{i}].content[{j}]", part


# Other media parts vLLM fetches by URL: their sources follow the images' rules (their sizes are vLLM's to bound).
_MEDIA_URL_PARTS = ("video_url", "audio_url")


def _media_parts(messages: list[dict], field: str) -> Iterator[tuple[str, str | None]]:
    for i, message in enumerate(messages):
        content = message.get("content")
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if isinstance(part, dict) and part.get("type") in _MEDIA_URL_PARTS:
                media = part.get(part["type"])
                yield f"{field}[{i}].content[{j}]", media.get("url") if isinstance(media, dict) else media


def check_chat_images(limits: GatewaySettings, messages: list[dict], field: str = "messages") -> None:
    """Count, size and source of the images of a chat request, and the source of its video and audio URLs;
    InvalidRequest (param `field`: the request's name for `messages`, items with content parts) when out of bounds."""
    for where, url in _media_parts(messages, field):
        if isinstance(url, str) and url[:5].lower() != "data:":
            _check_remote_url(limits, where, url)
    parts = list(_image_parts(messages, field))
    if len(parts) > limits.max_chat_images:
        raise InvalidRequest(f"{len(parts)} images; this gateway allows at most {limits.max_chat_images} per request",
                             param=field)
    for where, part in parts:
        if part.get("type") == "image":  # Anthropic's: a base64 or URL source
            source = part.get("source") if isinstance(part.get("source"), dict) else {}
            if source.get("type") == "base64" and isinstance(source.get("data"), str):
                _check_data_url(limits, where, source["data"], bare=True)
            elif source.get("type") == "url" and isinstance(source.get("url"), str):
                _check_remote_url(limits, where, source["url"])
            else:
                raise InvalidRequest(f'{where}: an image source must be {{"type": "base64", "data": ...}} or '
                                     '{"type": "url", "url": ...}', param=_param(where))
            continue
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, dict) else image
        if url is None and part.get("uuid") is not None:
            continue  # an image vLLM cached under this uuid: nothing to fetch or decode
        if not isinstance(url, str):
            raise InvalidRequest(f'{where}: image_url must be {{"url": "data:image/...;base64,..."}} or that URL '
                                 "as a string", param=_param(where))
        if url[:5].lower() == "data:":
            _check_data_url(limits, where, url)
        else:
            _check_remote_url(limits, where, url)


def _param(where: str) -> str:
    return where.split("[", 1)[0]


def _check_data_url(limits: GatewaySettings, where: str, url: str, bare: bool = False) -> None:
    try:
        data_url.decoded_size(data_url.payload(url, bare_allowed=bare), limits.max_image_bytes)
    except ValueError as exc:
        raise InvalidRequest(f"{where}: {exc}", param=_param(where)) from None


def _check_remote_url(limits: GatewaySettings, where: str, url: str) -> None:
    try:
        parts = urlsplit(url)
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https"):
        raise InvalidRequest(f"{where}: an image URL must be a base64 data URL (data:image/png;base64,...) or an "
                             "http(s) URL; file:, ftp: and other URLs are not accepted", param=_param(where))
    if "@" in parts.netloc or _AMBIGUOUS.search(url):
        raise InvalidRequest(f"{where}: an image URL may not hold credentials, spaces or backslashes",
                             param=_param(where))
    if parts.hostname not in {d.lower() for d in limits.chat_image_domains}:
        raise InvalidRequest(f"{where}: {_REMOTE}", param=_param(where))
