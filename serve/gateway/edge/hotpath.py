"""The hot routes (classify, embeddings, NER, chat and text completions) as lean ASGI handlers, in front of FastAPI's
routing.

A request there does what its FastAPI route does, in the same order and with the same answers: the body decoded with
orjson (422 saying why it is not JSON), the key checked (401), the body validated once against the route's pydantic
model (422), the key's scope and quota (403, 429), then the task's own serving function; its answer encoded once by
pydantic's serializer (a completion: relayed as vLLM sent it, or streamed). What it leaves out is the framework's
per-request machinery: dependency solving, a second validation of the response, Starlette's routing and exception
middlewares (benchmark B1 in ../shared/BENCH.md measures what that costs). A body that does not say it is JSON goes
to the FastAPI route, as do every other route and method; the FastAPI routes stay the documented API (OpenAPI) of
the same paths.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import orjson
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response

from ..access.auth import admit_key
from ..exceptions import GatewayError, gateway_error, http_error, unexpected_error, validation_error
from .recording import note_inputs


@dataclass(frozen=True)
class HotRoute:
    path: str
    request: type[BaseModel]
    serve: Callable[..., Awaitable[BaseModel]] | None = None  # (GatewayState, request) -> response
    exclude_none: bool = False
    # or (GatewayState, request, its key, its headers) -> the answer whole: a route that needs the caller and its
    # headers, and answers in a form of its own (generation: vLLM's answer as it came, or its stream)
    answer: Callable[..., Awaitable[Response]] | None = None


def _is_json(content_type: bytes | None) -> bool:
    """As FastAPI decides: no content type, application/json or application/*+json."""
    if not content_type:
        return True
    kind = content_type.split(b";", 1)[0].strip().lower()
    return kind == b"application/json" or (kind.startswith(b"application/") and kind.endswith(b"+json"))


class HotRoutes:
    def __init__(self, app, *, routes: list[HotRoute], state, documented: dict):
        """`documented`: path -> the FastAPI route of the same path (what the metrics label a request by)."""
        self.app, self.state, self.documented = app, state, documented
        self.routes = {r.path: r for r in routes}

    async def __call__(self, scope, receive, send):
        route = self.routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if route is None:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if not _is_json(headers.get(b"content-type")):
            return await self.app(scope, receive, send)
        scope["route"] = self.documented[route.path]
        state = scope.setdefault("state", {})
        try:
            answer = await self._answer(route, headers, state, receive)
        except GatewayError as exc:
            answer = gateway_error(exc, state.get("request_id", "-"))
        except RequestValidationError as exc:
            answer = validation_error(exc)
        except HTTPException as exc:  # the front door's 413 for a chunked body over the cap
            answer = http_error(exc.status_code, str(exc.detail), self.state.settings.max_body_bytes, exc.headers)
        except Exception:
            answer = unexpected_error(state.get("request_id", "-"))
        await answer(scope, receive, send)

    async def _answer(self, route: HotRoute, headers: dict, state: dict, receive) -> Response:
        body = await _read_body(receive)
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise RequestValidationError([{"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error",
                                           "input": {}, "ctx": {"error": exc.msg}}]) from None
        key = self.state.access.key_of(headers.get(b"authorization", b"").decode("latin-1"),
                                       headers.get(b"x-api-key", b"").decode("latin-1"), state)
        try:
            request = route.request.model_validate(data)
        except ValidationError as exc:
            raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None
        if route.answer is None:
            note_inputs(request.input)
        await admit_key(self.state, key, request.model, state)
        state["api_key"] = key
        if route.answer is not None:
            return await route.answer(self.state, request, key, headers)
        response = await route.serve(self.state, request)
        return Response(response.__pydantic_serializer__.to_json(response, exclude_none=route.exclude_none),
                        media_type="application/json")


async def _read_body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)
