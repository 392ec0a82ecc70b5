"""Admission control: at most `max_concurrency` model requests in flight per gateway worker, a bounded
wait queue behind them, and a fast 503 + Retry-After when both are full or a wait runs out. The same
gate, per model (`model_concurrency`), keeps one busy model from taking every slot of the others.

Without it an overload turns into unbounded queueing: every request waits, latency grows without
limit and clients time out on work that is then done for nobody. Shedding early keeps the admitted
requests fast. Only model calls (`POST /v1/...`) are admitted here; probes and metrics always answer.
"""

from __future__ import annotations

import asyncio

from . import metrics
from .exceptions import Overloaded, error_response


class Gate:
    """`limit` holders at once, at most `max_queue` waiting, each for at most `timeout_s`."""

    def __init__(self, limit: int, max_queue: int, timeout_s: float, what: str = "the gateway"):
        self.slots = asyncio.Semaphore(limit)
        self.max_queue, self.timeout_s, self.what = max_queue, timeout_s, what
        self.waiting = 0

    def _shed(self, why: str) -> Overloaded:
        metrics.SHED.labels(why).inc()
        return Overloaded(f"{self.what} is at capacity ({why}); retry shortly", retry_after=1)

    async def acquire(self) -> None:
        """A slot, or Overloaded at once when the queue is full or after `timeout_s` in it."""
        if not self.slots.locked():
            await self.slots.acquire()  # free: no wait
            return
        if self.waiting >= self.max_queue:
            raise self._shed("queue full")
        self.waiting += 1
        metrics.QUEUED.inc()
        try:
            async with asyncio.timeout(self.timeout_s):
                await self.slots.acquire()
        except TimeoutError:
            raise self._shed("queue wait timed out") from None
        finally:
            self.waiting -= 1
            metrics.QUEUED.dec()

    def release(self) -> None:
        self.slots.release()


class Admission:
    """The gateway-wide gate, as ASGI middleware: it runs before the body is read."""

    def __init__(self, app, *, max_concurrency: int, max_queue: int, queue_timeout_s: float):
        self.app = app
        self.gate = Gate(max_concurrency, max_queue, queue_timeout_s)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        try:
            await self.gate.acquire()
        except Overloaded as exc:
            refusal = error_response(exc.status, exc.message, exc.type, code=exc.code, retry_after=exc.retry_after)
            return await refusal(scope, receive, send)
        metrics.IN_FLIGHT.inc()
        try:
            await self.app(scope, receive, send)
        finally:
            self.gate.release()
            metrics.IN_FLIGHT.dec()
