"""vLLM client for the gateway: its OpenAI server over HTTP (loopback), requests already validated.

Streams are relayed chunk by chunk; closing the upstream response (client gone, deadline) makes
vLLM abort the generation.
"""

from __future__ import annotations

import logging

import httpx
from httpx_sse import EventSource
import orjson

from core.contract import TEXT_GENERATION

from ..exceptions import (
    BackendConnectFailed,
    BackendError,
    BackendTimeout,
    BackendUnavailable,
    InvalidRequest,
)
from .base import Backend, ModelInfo, Stream, StreamBroken, StreamChunk

log = logging.getLogger("rtxserve.gateway.vllm")


def _error(response: httpx.Response) -> tuple[str, str | None]:
    """vLLM's error message and the parameter it names, if any."""
    try:
        body = response.json()
    except ValueError:
        return "", None
    error = body.get("error", body) if isinstance(body, dict) else {}
    if not isinstance(error, dict):
        return str(error), None
    param = error.get("param")
    return str(error.get("message", "")), str(param) if isinstance(param, str) and param else None


def raise_for_status(response: httpx.Response, model: str) -> None:
    """Map a vLLM error answer to the gateway's error; vLLM's 400 messages are about the input."""
    if response.status_code < 400:
        return
    message, param = _error(response)
    log.warning("vllm %s: HTTP %s %s", model, response.status_code, message[:300])
    if response.status_code in (400, 422):
        raise InvalidRequest(message[:1000] or f"model {model} rejected the request", param=param)
    if response.status_code in (404, 503):
        raise BackendUnavailable(f"model {model} is not available right now; retry shortly")
    raise BackendError(f"model {model} failed to process the request")


class VLLMBackend(Backend):
    kind = "vllm"

    def __init__(self, url: str, timeout_s: float):
        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        self.client: httpx.AsyncClient | None = None

    async def start(self) -> None:
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200)
        self.client = httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(self.timeout_s, connect=2.0), limits=limits)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    async def discover(self) -> list[ModelInfo]:
        try:
            health = await self.client.get("/health", timeout=2.0)  # vLLM checks its engine here
            if health.status_code != 200:
                raise BackendUnavailable(f"vLLM at {self.url} reports its engine unhealthy ({health.status_code})")
            response = await self.client.get("/v1/models", timeout=2.0)
            response.raise_for_status()
            data = response.json().get("data", [])
        except (httpx.HTTPError, ValueError) as exc:
            raise BackendUnavailable(f"vLLM at {self.url} is unreachable: {type(exc).__name__}") from exc
        return [
            ModelInfo(name=m["id"], task=TEXT_GENERATION, backend=self.kind, ready=True,
                      extra={"max_model_len": m.get("max_model_len"), "parent": m.get("parent") or m.get("root")})
            for m in data
        ]

    async def _send(self, path: str, body: dict, model: str, stream: bool) -> httpx.Response:
        request = self.client.build_request("POST", path, content=orjson.dumps(body),
                                            headers={"content-type": "application/json"})
        try:
            return await self.client.send(request, stream=stream)
        except httpx.ConnectError as exc:  # nothing was sent: another replica may take it
            raise BackendConnectFailed(f"model {model} is not reachable; retry shortly") from exc
        except httpx.TimeoutException as exc:
            raise BackendTimeout(f"model {model} did not answer within the deadline") from exc
        except httpx.HTTPError as exc:  # sent, then the answer broke off (reset, cut, garbage): never resent
            log.warning("vllm %s: %s", model, type(exc).__name__)
            raise BackendError(f"model {model}'s answer broke off before it was complete") from exc

    async def generate(self, path: str, body: dict, model: str) -> dict:
        response = await self._send(path, body, model, stream=False)
        raise_for_status(response, model)
        try:
            return orjson.loads(response.content)
        except orjson.JSONDecodeError as exc:
            raise BackendError(f"model {model} sent an answer that is not JSON") from exc

    async def open_stream(self, path: str, body: dict, model: str) -> Stream:
        response = await self._send(path, body, model, stream=True)
        if response.status_code >= 400:
            await response.aread()
            await response.aclose()
            raise_for_status(response, model)
        return SSEStream(response, model)


class SSEStream(Stream):
    """vLLM's server-sent events: `data: {json}` lines ending with `data: [DONE]`."""

    def __init__(self, response: httpx.Response, model: str):
        self.response, self.model = response, model

    async def __aiter__(self):
        # httpx-sse splits lines where SSE does (CR, LF, CRLF); httpx's own aiter_lines also splits on U+2028,
        # U+0085 and the like, which vLLM's JSON carries unescaped when a model writes them.
        try:
            async for event in EventSource(self.response).aiter_sse():
                payload = event.data.strip()
                if not payload:
                    continue
                if payload == "[DONE]":
                    return
                try:
                    chunk = orjson.loads(payload)
                except orjson.JSONDecodeError:
                    raise StreamBroken("unparsable stream chunk") from None
                if not isinstance(chunk, dict) or "error" in chunk:
                    raise StreamBroken(f"error in stream: {str(chunk.get('error') if isinstance(chunk, dict) else chunk)[:300]}")
                yield StreamChunk(chunk, payload)
        except httpx.HTTPError as exc:
            raise StreamBroken(f"stream broke: {type(exc).__name__}") from exc
        raise StreamBroken("stream ended without [DONE]")

    async def aclose(self) -> None:
        await self.response.aclose()  # also what aborts the generation in vLLM when the client left
