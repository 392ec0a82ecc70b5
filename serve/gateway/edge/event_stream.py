"""A streamed answer (server-sent events) as the gateway sends it: each chunk as it comes, and the stream stopped the
moment the client leaves.

Starlette's StreamingResponse does the same under uvicorn (ASGI 2.3: a send after the client left is dropped, not
raised) with an anyio task group per answer, whose cancel scope the stream runs in. Here the chunks are sent by a task
of their own, whose stack is a few frames deep rather than the request's fifteen or so (the server, the framework, each
middleware): every chunk resumes that stack when it arrives, so a shallow one costs less per token. One watcher task
waits for the disconnect and cancels it: a generation the client no longer reads is stopped at once, its upstream
connection closed (which makes vLLM abort it), whether it is sending or still waiting for its next token.

The answer's start goes through every middleware; its chunks go to the server's own `send` where the app put it in the
scope (WIRE): each middleware of the gateway (metrics, the front door, the trace, Starlette's error handler) acts on a
response's start only, and passing a token through each of their wrappers cost a coroutine call apiece. A middleware
that changed a body (compression) would have to see the chunks, and this would have to send them through it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.responses import Response

WIRE = "rtxserve.wire"  # the scope's key for the server's own send (app.py puts it there)


class EventStream(Response):
    """`events`: an async iterator of the answer's chunks, or what pushes them (`pump(send)`, generate/serving.py's
    relay: no generator between the backend's socket and the client's)."""

    media_type = "text/event-stream"

    def __init__(self, events):
        self.events, self.status_code, self.background = events, 200, None
        self.init_headers({"Cache-Control": "no-cache"})

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        ended = asyncio.Event()  # the last chunk sent: the client may read it and leave, which cancels nothing
        pump = asyncio.ensure_future(self._pump(scope.get(WIRE, send), ended))

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            if not ended.is_set():
                pump.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await pump
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # the request itself was cancelled (the pump is, with it)
                raise
            # the client left: the stream is over, nothing to answer
        finally:
            watcher.cancel()

    async def _pump(self, send, ended: asyncio.Event) -> None:
        async def body(chunk: bytes) -> None:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})

        try:
            pump = getattr(self.events, "pump", None)
            if pump is not None:
                await pump(body)
            else:
                async for chunk in self.events:
                    await body(chunk)
            ended.set()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await _closed(self.events)


async def _closed(events: AsyncIterator[bytes]) -> None:
    """The events' generator closed (its `finally` run: the upstream stream closed) wherever it stopped."""
    close = getattr(events, "aclose", None)
    if close is not None:
        await close()
