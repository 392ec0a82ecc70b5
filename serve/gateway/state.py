"""What the gateway knows about its backend replicas, and how a call is routed to one of them.

Each replica (one Triton server, one vLLM engine per GPU, ...) has its own health, in-flight count and
circuit breaker (the `circuitbreaker` library). A background loop refreshes what every replica serves
every `health_interval_s`, so request handling and `/readyz` read memory instead of calling backends.

A call goes to the least busy replica that serves the model, is up and whose breaker is not open. Only
a connection that could not be made (nothing was sent) is tried again, on another replica (tenacity);
a request that reached a backend is never sent twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import TypeVar

from circuitbreaker import STATE_OPEN, CircuitBreaker
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt

from core import contract

from . import metrics
from .admission import Gate
from .backends.base import Backend, ModelInfo, Stream
from .exceptions import (
    BackendConnectFailed,
    BackendError,
    BackendTimeout,
    BackendUnavailable,
    GatewayError,
    InvalidRequest,
    ModelNotFound,
)
from .keys import KeyRing
from .quotas import Quotas
from .settings import GatewaySettings

log = logging.getLogger("rtxserve.gateway")
T = TypeVar("T")
# What opens a replica's breaker: the backend failing, not the client's request being wrong.
_BREAKS = (BackendUnavailable, BackendTimeout, BackendError)


# A model is ready only once it has answered one real request of its task (deep readiness): a model that loads
# but cannot infer must not take traffic. Each task declares its request beside its route (canaries.py lists them).
Canary = Callable[[Backend, ModelInfo, float], Awaitable[object]]


@dataclass(eq=False)
class Replica:
    backend: Backend
    breaker: CircuitBreaker
    up: bool = False
    in_flight: int = 0
    picks: int = 0  # tie-break among equally busy replicas: round robin
    models: dict[str, ModelInfo] = field(default_factory=dict)
    canaried: set[str] = field(default_factory=set)  # models that answered their first request here
    last_ok: dict[str, float] = field(default_factory=dict)  # model -> when it last answered a request here

    @property
    def name(self) -> str:
        return self.backend.name

    def serves(self, model: str) -> bool:
        info = self.models.get(model)
        return self.up and info is not None and info.ready and self.breaker.state != STATE_OPEN


class _HeldStream(Stream):
    """A stream that keeps its replica counted busy until it is closed."""

    def __init__(self, stream: Stream, release: Callable[[], None]):
        self.stream, self._release = stream, release

    def __aiter__(self):
        return self.stream.__aiter__()

    async def aclose(self) -> None:
        try:
            await self.stream.aclose()
        finally:
            self._release()
            self._release = lambda: None


# The API key name of the request being served (set where its key is admitted): what a sticky alias keeps on one model.
CALLER: ContextVar[str | None] = ContextVar("rtxserve_caller", default=None)


class GatewayState:
    def __init__(self, settings: GatewaySettings, backends: list[Backend], canaries: Mapping[str, Canary]):
        self.settings = settings
        self.canaries = canaries
        self.replicas = [
            Replica(b, CircuitBreaker(failure_threshold=settings.breaker_failures,
                                      recovery_timeout=settings.breaker_reset_s, expected_exception=_BREAKS, name=b.name))
            for b in backends
        ]
        self.models: dict[str, ModelInfo] = {}  # every replica's models, ready when one replica serves it
        self.keys = KeyRing(settings.keys_file) if settings.keys_file else None
        self.quotas = (Quotas(settings.rate_limit_storage or "async+memory://", settings.rate_limit_unavailable)
                       if self.keys else None)
        self.draining = False
        self.last_refresh = 0.0
        self.gates = {m: Gate(n, settings.max_queue, settings.queue_timeout_s, f"model {m!r}")
                      for m, n in settings.model_concurrency.items()}

    async def _refresh_replica(self, replica: Replica) -> None:
        try:
            found = await replica.backend.discover()
        except BackendUnavailable as exc:
            if replica.up:
                log.warning("backend %s went down: %s", replica.name, exc.message)
            replica.up = False
            # Keep the models it served, marked not ready: clients get 503, not 404, while it is down.
            replica.models = {n: replace(m, ready=False) for n, m in replica.models.items()}
            return
        if not replica.up:
            log.info("backend %s is up: %s", replica.name, ", ".join(m.name for m in found) or "no models")
            replica.canaried.clear()  # a backend that came back is checked again
        replica.up = True
        # Triton may call a model ready that cannot answer (a Python stub that died stays READY): an encoder
        # model that answered nothing here since the last check answers a canary now. (vLLM's /health checks
        # its own engine; a generation every interval would only add phantom requests to its metrics.)
        check = [m for m in found if m.ready and m.task in self.canaries and (
            m.name not in replica.canaried
            or (m.task in contract.ENCODER_TASKS and replica.last_ok.get(m.name, 0.0) < self.last_refresh))]
        passed = await asyncio.gather(*(self._canary(replica, m) for m in check))
        failed = {m.name for m, ok in zip(check, passed) if not ok}
        replica.models = {m.name: replace(m, ready=False) if m.name in failed else m for m in found}

    async def _canary(self, replica: Replica, model: ModelInfo) -> bool:
        known = model.name in replica.canaried
        try:
            await self.canaries[model.task](replica.backend, model, self.settings.request_timeout_s)
        except (BackendTimeout, BackendUnavailable):
            if known:  # busy or going down (the next discover tells): not evidence that the model broke
                return True
            failure = "did not answer its first request"
        except Exception as exc:  # whatever it is, the model does not take traffic (again) until it answers
            failure = f"failed a {'health' if known else 'first'} request ({getattr(exc, 'message', type(exc).__name__)})"
        else:
            replica.canaried.add(model.name)
            replica.last_ok[model.name] = time.monotonic()
            return True
        log.warning("backend %s: model %s is loaded but %s; not ready", replica.name, model.name, failure)
        replica.canaried.discard(model.name)
        return False

    async def refresh(self) -> None:
        await asyncio.gather(*(self._refresh_replica(r) for r in self.replicas))
        merged: dict[str, ModelInfo] = {}
        for replica in self.replicas:
            for name, info in replica.models.items():
                if name not in merged or (info.ready and not merged[name].ready):
                    merged[name] = info
        self.models = {n: replace(m, ready=any(r.serves(n) for r in self.replicas)) for n, m in merged.items()}
        for replica in self.replicas:
            metrics.BACKEND_UP.labels(replica.name).set(1 if replica.up else 0)
            metrics.BREAKER_OPEN.labels(replica.name).set(1 if replica.breaker.state == STATE_OPEN else 0)
        self.last_refresh = time.monotonic()

    async def run_health_loop(self) -> None:
        """Refresh every health interval, after the first look the gateway takes at start."""
        while True:
            await asyncio.sleep(self.settings.health_interval_s)
            try:
                await self.refresh()
            except Exception:  # the loop must survive anything a backend does
                log.exception("health refresh failed")

    def unknown_routes(self) -> list[str]:
        """The models the aliases and fallbacks name that no backend serves, once every backend has answered (while
        one is down, what it serves is not known: nothing is called unknown)."""
        if not all(r.up for r in self.replicas):
            return []
        return sorted(self.settings.route_names() - set(self.models))

    def ready(self) -> tuple[bool, dict]:
        """Ready when not draining and every required model (default: all known) is served by a live replica."""
        required = self.settings.required_models or list(self.models)
        missing = [n for n in required if n not in self.models or not self.models[n].ready]
        ok = not self.draining and bool(required) and not missing

        def replica_state(r: Replica) -> str:
            broken = sorted(n for n, m in r.models.items() if not m.ready) if r.up else []
            return (("up" if r.up else "down") + (", breaker open" if r.breaker.state == STATE_OPEN else "")
                    + (f", not ready: {', '.join(broken)}" if broken else ""))

        detail = {
            "backends": {r.name: replica_state(r) for r in self.replicas},
            "models": {n: ("ready" if n in self.models and self.models[n].ready else "not ready") for n in required},
        }
        if self.draining:
            detail["draining"] = True
        return ok, detail

    def resolve(self, name: str, task: str | tuple[str, ...], key: str | None = None, user: str | None = None) -> ModelInfo:
        """The model a request names (of one of the tasks `task` names), or the error the client should get.

        An alias (settings.aliases) is one of its targets, by weight: the same one for the same API `key` name or
        request `user` where the alias is sticky by it, else drawn per request. A model with no live replica is
        answered by its first ready fallback (settings.fallbacks) of the same task."""
        alias = self.settings.aliases.get(name)
        if alias is not None:
            target = _draw(alias.targets, {"key": key or CALLER.get(), "user": user}.get(alias.sticky))
            metrics.ALIAS_REQUESTS.labels(name, target).inc()
            name = target
        try:
            return self._resolve(name, task)
        except BackendUnavailable as exc:
            for fallback in self._fallbacks(name, task, exc):
                return fallback
            raise

    def _fallbacks(self, name: str, task: str | tuple[str, ...], why: BackendUnavailable):
        """The ready fallbacks of `name` (settings.fallbacks) of one of the tasks, in order, each logged and counted
        as it is taken."""
        for fallback in self.settings.fallbacks.get(name, ()):
            with contextlib.suppress(GatewayError):
                info = self._resolve(fallback, task)
                log.warning("model %s has no live replica (%s): answering with its fallback %s", name, why.message,
                            fallback)
                metrics.FALLBACKS.labels(name, fallback).inc()
                yield info

    def _resolve(self, name: str, task: str | tuple[str, ...]) -> ModelInfo:
        if name not in self.models:
            if not all(r.up for r in self.replicas):
                raise BackendUnavailable(f"model {name!r} is unknown while a backend is down; retry shortly")
            raise ModelNotFound(f"model {name!r} does not exist; GET /v1/models lists the models", param="model")
        info = self.models[name]
        tasks = (task,) if isinstance(task, str) else task
        if info.task not in tasks:
            raise InvalidRequest(f"model {name!r} is a {info.task} model, not {' or '.join(tasks)}", param="model")
        if not info.ready:
            raise BackendUnavailable(f"model {name!r} is not ready; retry shortly")
        return info

    def _pick(self, model: str, tried: set[Replica], affinity: str | None = None) -> Replica:
        """The least busy live replica; with an `affinity` (one conversation's key), the replica that key hashes to
        unless it is over its share of the load, then the next one it hashes to (rendezvous hashing with bounded
        loads: a replica takes at most affinity_load_factor x the average in flight, counting this request), so
        that one conversation finds its prefix in one engine's cache and one hot session cannot swamp a replica."""
        candidates = [r for r in self.replicas if r not in tried and r.serves(model)]
        if not candidates:
            waits = [r.breaker.open_remaining for r in self.replicas if r.breaker.state == STATE_OPEN]
            raise BackendUnavailable(f"model {model!r} has no live replica right now; retry shortly",
                                     retry_after=max(1.0, min(waits, default=1.0)))
        replica = None
        if affinity is not None and len(candidates) > 1:
            cap = math.ceil(self.settings.affinity_load_factor * (sum(r.in_flight for r in candidates) + 1)
                            / len(candidates))
            ranked = sorted(candidates, reverse=True, key=lambda r: hashlib.blake2b(
                f"{affinity}\0{r.name}".encode(), digest_size=8).digest())
            replica = next((r for r in ranked if r.in_flight < cap), None)
            metrics.AFFINITY.labels("preferred" if replica is ranked[0] else "spilled").inc()
        if replica is None:
            replica = min(candidates, key=lambda r: (r.in_flight, r.picks))
        replica.picks += 1
        return replica

    async def call(self, info: ModelInfo, fn: Callable[[Backend, ModelInfo], Awaitable[T]],
                   affinity: str | None = None) -> T:
        """Run `fn(backend, model_info)` on the least busy live replica serving `info.name`, within the model's
        own concurrency limit if it has one. A failed connect is tried on the next replica; anything else is
        the answer. A Stream keeps its replica (and its slot) busy until closed. A model with no live replica left
        is answered by its fallbacks (settings.fallbacks), in order, before a stream has begun. `affinity`: see
        _pick."""
        chain = self.settings.fallbacks.get(info.name)
        if not chain:
            return await self._gated(info, fn, affinity)
        try:
            return await self._gated(info, fn, affinity)
        except BackendUnavailable as exc:
            for fallback in self._fallbacks(info.name, info.task, exc):
                with contextlib.suppress(BackendUnavailable):
                    return await self._gated(fallback, fn, affinity)
            raise

    async def _gated(self, info: ModelInfo, fn: Callable[[Backend, ModelInfo], Awaitable[T]],
                     affinity: str | None = None) -> T:
        gate = self.gates.get(info.name)
        if gate is None:
            return await self._call(info, fn, affinity)
        await gate.acquire()
        try:
            result = await self._call(info, fn, affinity)
        except BaseException:
            gate.release()
            raise
        if isinstance(result, Stream):
            return _HeldStream(result, gate.release)
        gate.release()
        return result

    async def _call(self, info: ModelInfo, fn: Callable[[Backend, ModelInfo], Awaitable[T]],
                    affinity: str | None = None) -> T:
        first = self._pick(info.name, set(), affinity)
        try:
            return await self._run(first, info, fn)  # the hot path: no retry machinery unless it is needed
        except BackendConnectFailed:
            tried = {first}
            others = sum(1 for r in self.replicas if r not in tried and r.serves(info.name))
            if not others:
                raise
        async for attempt in AsyncRetrying(retry=retry_if_exception_type(BackendConnectFailed),
                                           stop=stop_after_attempt(others), reraise=True):
            with attempt:
                replica = self._pick(info.name, tried, affinity)
                tried.add(replica)
                return await self._run(replica, info, fn)
        raise AssertionError("unreachable")  # AsyncRetrying either returns or re-raises

    async def _run(self, replica: Replica, info: ModelInfo, fn) -> T:
        replica.in_flight += 1
        start = time.perf_counter()
        held = False

        def release() -> None:
            replica.in_flight -= 1

        try:
            with replica.breaker:  # a _BREAKS error counts towards opening it; a success closes it
                result = await fn(replica.backend, replica.models.get(info.name, info))
            replica.last_ok[info.name] = time.monotonic()
            if isinstance(result, Stream):
                held = True
                return _HeldStream(result, release)
            return result
        finally:
            took = time.perf_counter() - start
            metrics.BACKEND_SECONDS.labels(replica.name).observe(took)
            waited = metrics.BACKEND_WAIT.get(None)
            if waited is not None:
                waited[0] += took
            if replica.breaker.state == STATE_OPEN:
                metrics.BREAKER_OPEN.labels(replica.name).set(1)
            if not held:
                release()


def _draw(weights: dict[str, int], who: str | None) -> str:
    """One of `weights`' models with its weight's chance: drawn at random, or, for a `who`, from a hash of it (the same
    `who` always gets the same model while the weights stay)."""
    point = (int.from_bytes(hashlib.blake2b(who.encode(), digest_size=8).digest()) % 100 if who is not None
             else random.randrange(100))
    for model, weight in weights.items():
        if point < weight:
            return model
        point -= weight
    raise AssertionError("weights sum to 100 (settings.Alias)")
