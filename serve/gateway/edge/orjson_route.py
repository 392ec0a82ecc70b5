"""The route class every gateway router uses: request bodies are parsed with orjson.

orjson is several times faster than the standard library, refuses what is not valid UTF-8 (a lone
surrogate such as "\\ud800" would otherwise reach the tokenizer and fail there) and stops at a nesting
depth of 1024 (the standard parser recurses until RecursionError). Its errors are JSONDecodeError,
which FastAPI turns into a 422 like any other malformed body.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

import orjson
from fastapi import APIRouter, Request
from fastapi.routing import APIRoute

from ..exceptions import ERROR_RESPONSES, ClientGone

T = TypeVar("T")


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


async def unless_client_leaves(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or its cancellation when the client disconnects first (an answered-whole request whose body
    was read to its end: what it waits on is then only its answer). Cancelling a backend call closes its
    connection, which is what makes vLLM abort the request."""
    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        raise ClientGone("the client disconnected before its answer was ready")
    return task.result()


def gateway_router(**kwargs) -> APIRouter:
    """A router whose routes parse with orjson and document every error answer."""
    kwargs.setdefault("responses", ERROR_RESPONSES)
    return APIRouter(route_class=GatewayRoute, **kwargs)
