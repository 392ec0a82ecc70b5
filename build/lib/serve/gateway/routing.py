"""The route class every gateway router uses: request bodies are parsed with orjson.

orjson is several times faster than the standard library, refuses what is not valid UTF-8 (a lone
surrogate such as "\\ud800" would otherwise reach the tokenizer and fail there) and stops at a nesting
depth of 1024 (the standard parser recurses until RecursionError). Its errors are JSONDecodeError,
which FastAPI turns into a 422 like any other malformed body.
"""

from __future__ import annotations

import orjson
from fastapi import APIRouter, Request
from fastapi.routing import APIRoute

from .exceptions import ERROR_RESPONSES


class _OrjsonRequest(Request):
    async def json(self):
        if not hasattr(self, "_json"):
            self._json = orjson.loads(await self.body())
        return self._json


class GatewayRoute(APIRoute):
    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request):
            return await handler(_OrjsonRequest(request.scope, request.receive))

        return route


def gateway_router(**kwargs) -> APIRouter:
    """A router whose routes parse with orjson and document every error answer."""
    kwargs.setdefault("responses", ERROR_RESPONSES)
    return APIRouter(route_class=GatewayRoute, **kwargs)
