"""A streamed answer (server-sent events) as the gateway sends it: each chunk as it comes, and the stream stopped the
moment the client leaves.

Starlette's StreamingResponse does the same under uvicorn (ASGI 2.3: a send after the client left is dropped, not
raised) with an anyio task group per answer, whose cancel scope the stream runs in. Here the stream runs in the
request's own task and one watcher task waits for the disconnect and cancels it: a generation the client no longer
reads is stopped at once, its upstream connection closed (which makes vLLM abort it), whether it is sending or still
waiting for its next token.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.responses import Response


class EventStream(Response):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes]):
        self.events, self.status_code, self.background = events, 200, None
        self.init_headers({"Cache-Control": "no-cache"})

    async def __call__(self, scope, receive, send) -> None:
        task, gone = asyncio.current_task(), asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()
            task.cancel()

        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        watcher = asyncio.ensure_future(watch())
        try:
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            watcher.cancel()  # before the answer's end, which the client may read and leave after
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not gone.is_set():
                raise
            task.uncancel()  # the client left: the stream is over, nothing to answer
        finally:
            watcher.cancel()
            await _closed(self.events)


async def _closed(events: AsyncIterator[bytes]) -> None:
    """The events' generator closed (its `finally` run: the upstream stream closed) wherever it stopped."""
    close = getattr(events, "aclose", None)
    if close is not None:
        await close()
