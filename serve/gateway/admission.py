"""Admission control: at most `max_concurrency` model requests in flight per gateway worker, a bounded
wait queue behind them, and a fast 503 + Retry-After when both are full or a wait runs out.

Without it an overload turns into unbounded queueing: every request waits, latency grows without
limit and clients time out on work that is then done for nobody. Shedding early keeps the admitted
requests fast. Only model calls (`POST /v1/...`) are admitted here; probes and metrics always answer.
"""

from __future__ import annotations

import asyncio

from . import metrics
from .exceptions import error_response


class Admission:
    def __init__(self, app, *, max_concurrency: int, max_queue: int, queue_timeout_s: float):
        self.app, self.max_queue, self.queue_timeout_s = app, max_queue, queue_timeout_s
        self.slots = asyncio.Semaphore(max_concurrency)
        self.waiting = 0

    async def _shed(self, scope, receive, send, why: str) -> None:
        metrics.SHED.labels(why).inc()
        refusal = error_response(503, f"the gateway is at capacity ({why}); retry shortly", "service_unavailable",
                                 code="overloaded", retry_after=1)
        await refusal(scope, receive, send)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        if self.slots.locked():
            if self.waiting >= self.max_queue:
                return await self._shed(scope, receive, send, "queue full")
            self.waiting += 1
            metrics.QUEUED.inc()
            try:
                async with asyncio.timeout(self.queue_timeout_s):
                    await self.slots.acquire()
            except TimeoutError:
                return await self._shed(scope, receive, send, "queue wait timed out")
            finally:
                self.waiting -= 1
                metrics.QUEUED.dec()
        else:
            await self.slots.acquire()
        metrics.IN_FLIGHT.inc()
        try:
            await self.app(scope, receive, send)
        finally:
            self.slots.release()
            metrics.IN_FLIGHT.dec()
