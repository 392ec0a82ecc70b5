"""Admission control: at most `max_concurrency` model requests in flight per gateway worker, a bounded
wait queue behind them, and a fast 503 + Retry-After when both are full or a wait runs out. The same
gate, per model (`model_concurrency`), keeps one busy model from taking every slot of the others.

Without it an overload turns into unbounded queueing: every request waits, latency grows without
limit and clients time out on work that is then done for nobody. Shedding early keeps the admitted
requests fast. Only model calls (`POST /v1/...`) are admitted here; probes and metrics always answer.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque

from .. import metrics
from ..exceptions import GatewayError, Overloaded, error_response


class Gate:
    """`limit` holders at once, at most `max_queue` waiting, each for at most `timeout_s`.

    A freed slot goes to the waiting request of the lowest priority number (a key's `priority`: interactive 0 before
    batch 10), and among those, to each key in turn (round robin over the keys with requests waiting, oldest first
    within a key), so that one key's flood cannot starve another key's trickle."""

    def __init__(self, limit: int, max_queue: int, timeout_s: float, what: str = "the gateway"):
        self.limit, self.in_use = limit, 0
        self.max_queue, self.timeout_s, self.what = max_queue, timeout_s, what
        self.waiting = 0
        self._queues: dict[int, OrderedDict[str, deque[asyncio.Future]]] = {}  # priority -> key -> its waiters

    def _shed(self, why: str, priority: int) -> Overloaded:
        metrics.SHED.labels(why).inc()
        metrics.PRIORITY_SHED.labels(str(priority)).inc()
        return Overloaded(f"{self.what} is at capacity ({why}); retry shortly", retry_after=1)

    @property
    def busy(self) -> bool:
        """A request now would wait (and so needs its priority)."""
        return self.in_use >= self.limit or self.waiting > 0

    async def acquire(self, priority: int = 0, key: str = "") -> None:
        """A slot, or Overloaded at once when the queue is full or after `timeout_s` in it."""
        if self.in_use < self.limit and not self.waiting:  # free, and nobody before it: no wait
            self.in_use += 1
            return
        if self.waiting >= self.max_queue:
            raise self._shed("queue full", priority)
        served = asyncio.get_running_loop().create_future()
        self._queues.setdefault(priority, OrderedDict()).setdefault(key, deque()).append(served)
        self.waiting += 1
        metrics.QUEUED.inc()
        metrics.PRIORITY_QUEUED.labels(str(priority)).inc()
        start = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout_s):
                await asyncio.shield(served)
        except BaseException as exc:  # the wait ran out, or the client left while waiting
            if served.done() and not served.cancelled():  # handed the slot just then: give it on
                self.release()
            served.cancel()  # skipped where it waits (a cancelled waiter is never handed a slot)
            if isinstance(exc, TimeoutError):
                raise self._shed("queue wait timed out", priority) from None
            raise
        finally:
            self.waiting -= 1
            metrics.QUEUED.dec()
            metrics.PRIORITY_QUEUED.labels(str(priority)).dec()
            metrics.PRIORITY_WAIT.labels(str(priority)).observe(time.perf_counter() - start)

    def release(self) -> None:
        """Hand the slot to the next waiter (`_next`), or free it."""
        waiter = self._next()
        if waiter is None:
            self.in_use -= 1
        else:
            waiter.set_result(None)

    def _next(self) -> asyncio.Future | None:
        for priority in sorted(self._queues):
            keys = self._queues[priority]
            while keys:
                key, waiters = next(iter(keys.items()))
                keys.move_to_end(key)  # the next slot of this priority goes to the next key
                while waiters and waiters[0].done():  # timed out: skipped
                    waiters.popleft()
                if not waiters:
                    del keys[key]
                    continue
                waiter = waiters.popleft()
                if not waiters:
                    del keys[key]
                return waiter
            del self._queues[priority]
        return None


class Admission:
    """The gateway-wide gate, as ASGI middleware: it runs before the body is read. A request that must wait is queued by
    its key's priority and name (the client's address where the gateway has no keys), read from its headers only
    then: a free slot costs no key lookup."""

    def __init__(self, app, *, max_concurrency: int, max_queue: int, queue_timeout_s: float, access=None):
        self.app = app
        self.gate = Gate(max_concurrency, max_queue, queue_timeout_s)
        self.access = access  # access.Access: the keys
        self.quotas = getattr(access, "quotas", None)  # quotas.Quotas: the keys found over their quota

    def _key(self, scope):
        """The key the headers name; None without keys, or where they name none (refused once admitted)."""
        headers = {k: v for k, v in scope.get("headers", ()) if k in (b"authorization", b"x-api-key")}
        try:
            return self.access.key_of(headers.get(b"authorization", b"").decode("latin-1"),
                                      headers.get(b"x-api-key", b"").decode("latin-1"), scope.get("state"))
        except GatewayError:
            return None

    def _caller(self, scope) -> tuple[int, str]:
        key = self._key(scope) if self.access is not None else None
        if key is None:  # no keys: by the client's address; no or a wrong key: queued as nobody
            return (0, (scope.get("client") or ("",))[0]) if self.access is None or self.access.keys is None else (0, "")
        return key.priority, key.name

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        if self.quotas is not None and self.quotas.spent:  # a key over its quota: refused before its body is read
            key = self._key(scope)
            refused = self.quotas.refusal(key) if key is not None else None
            if refused is not None:
                return await error_response(refused.status, refused.message, refused.type, code=refused.code,
                                            retry_after=refused.retry_after)(scope, receive, send)
        try:
            await self.gate.acquire(*self._caller(scope)) if self.gate.busy else await self.gate.acquire()
        except Overloaded as exc:
            refusal = error_response(exc.status, exc.message, exc.type, code=exc.code, retry_after=exc.retry_after)
            return await refusal(scope, receive, send)
        metrics.IN_FLIGHT.inc()
        try:
            await self.app(scope, receive, send)
        finally:
            self.gate.release()
            metrics.IN_FLIGHT.dec()
