"""How a call reaches a replica: the model a request names (aliases, fallbacks), the replica that takes it (least busy,
or a conversation's own), its model's concurrency gate, and what is tried again.

A call goes to the least busy replica that serves the model, is up and whose breaker is not open. Only a connection
that could not be made (nothing was sent) is tried again, on another replica (tenacity); a request that reached a
backend is never sent twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TypeVar

from circuitbreaker import STATE_OPEN
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt

from .. import metrics
from ..access.caller import CALLER, CALLER_PRIORITY
from ..access.keys import PRIORITIES
from ..backends.base import Backend, ModelInfo, Stream
from ..edge.admission import Gate
from ..exceptions import BackendConnectFailed, BackendUnavailable, GatewayError, InvalidRequest, ModelNotFound
from ..settings import GatewaySettings
from .answer_cache import AnswerCache, Rows
from .prefix import Prefix
from .registry import BREAKS, Registry, Replica
from .residency import Residency
from .rollout.shadow import mirror
from .rollout.table import Rollout
from .yielding import PeopleFirst

log = logging.getLogger("rtxserve.gateway")
T = TypeVar("T")


class _Wrapped(Stream):
    """A stream handed on as it is, chunk for chunk: a wrapper adds what it does at the first chunk and at the end."""

    def __init__(self, stream: Stream):
        self.stream = stream

    def __aiter__(self):
        return self.stream.__aiter__()

    def pump(self, deliver):
        """The wrapped stream's own pump, not a coroutine of this one: a token's event resumes no frame of a wrapper
        (a stream is wrapped up to four deep: its replica, the model's gate, a person's first token, a loaded model)."""
        return self.stream.pump(deliver)

    def first_chunk(self) -> None:
        self.stream.first_chunk()

    async def aclose(self) -> None:
        await self.stream.aclose()


class _HeldStream(_Wrapped):
    """A stream that keeps its replica counted busy until it is closed."""

    def __init__(self, stream: Stream, release: Callable[[], None]):
        super().__init__(stream)
        self._release = release

    async def aclose(self) -> None:
        try:
            await self.stream.aclose()
        finally:
            self._release()
            self._release = lambda: None


class _FirstChunk(_Wrapped):
    """A stream that calls `seen` at its first chunk (what relays it says when), or when it is closed before one."""

    def __init__(self, stream: Stream, seen: Callable[[], None]):
        super().__init__(stream)
        self._seen = seen

    def first_chunk(self) -> None:
        self._seen()
        self.stream.first_chunk()

    async def aclose(self) -> None:
        self._seen()
        await self.stream.aclose()


class Dispatcher:
    def __init__(self, settings: GatewaySettings, registry: Registry, residency: Residency, rollout: Rollout):
        self.settings = settings
        self.registry = registry
        self.residency = residency
        self.rollout = rollout
        self._shadows: set[asyncio.Task] = set()  # held until done: the loop keeps only weak references to tasks
        self.busy: Counter[str] = Counter()  # model -> its calls in flight here (a stream until it ends)
        self.gates = {m: Gate(n, settings.max_queue, settings.queue_timeout_s, f"model {m!r}")
                      for m, n in settings.model_concurrency.items()}
        self.answers = AnswerCache(settings.response_cache_mb)
        self.people = PeopleFirst(settings.batch_floor) if settings.batch_yields else None
        registry.on_unready.append(self.answers.forget)

    async def resolve(self, name: str, task: str | tuple[str, ...], key: str | None = None,
                      user: str | None = None) -> ModelInfo:
        """The model a request names (of one of the tasks `task` names), or the error the client should get.

        An alias (settings.aliases, or a name a promotion routes: rollout/) is one of its targets, by weight (a
        promotion's route may name the model of its own name): the same one for the same API `key` name or
        request `user` where the alias is sticky by it, else drawn per request. An on-demand model not loaded is
        loaded first (residency.py). A model with no live replica is answered by its first ready fallback
        (settings.fallbacks) of the same task."""
        alias = self.rollout.routes.get(name)
        if alias is not None:
            target = _draw(alias.targets, {"key": key or CALLER.get(), "user": user}.get(alias.sticky))
            metrics.ALIAS_REQUESTS.labels(name, target).inc()
            name = target
        owner = self.settings.on_demand_owner(name)
        if owner and name in self.registry.models:
            self._resolve(name, task, loaded=False)  # its task, before anything is loaded for it
            await self.residency.ensure(owner)
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

    def check_served(self, name: str) -> None:
        """Nothing if `name` is an alias or a model served here; else what a request naming it gets: 404, or 503
        while a backend is down (the model may be one of its)."""
        if name not in self.rollout.routes:
            self._check_model(name)

    def _check_model(self, name: str) -> None:
        if name not in self.registry.models:
            if not all(r.up for r in self.registry.replicas):
                raise BackendUnavailable(f"model {name!r} is unknown while a backend is down; retry shortly")
            raise ModelNotFound(f"model {name!r} does not exist; GET /v1/models lists the models", param="model")

    def _resolve(self, name: str, task: str | tuple[str, ...], loaded: bool = True) -> ModelInfo:
        self._check_model(name)
        info = self.registry.models[name]
        tasks = (task,) if isinstance(task, str) else task
        if info.task not in tasks:
            raise InvalidRequest(f"model {name!r} is a {info.task} model, not {' or '.join(tasks)}", param="model")
        if loaded and not info.ready:
            raise BackendUnavailable(f"model {name!r} is not ready; retry shortly")
        return info

    def replicated(self, model: str) -> bool:
        """Whether several replicas serve `model`: where picking one by a request's prefix has a choice to make."""
        return sum(model in r.models for r in self.registry.replicas) > 1

    def _pick(self, model: str, tried: set[Replica], prefix: Prefix | None = None) -> Replica:
        """The least busy live replica; with a `prefix` (cache-aware routing, prefix.py), the replica that holds the most
        of it, less its share of the tokens in flight (settings.affinity_load_weight), among those under the load cap (a
        replica takes at most affinity_load_factor x the average in flight, counting this request); least busy where
        none holds any of it. The chosen replica records the prefix as sent."""
        candidates = [r for r in self.registry.replicas if r not in tried and r.serves(model)]
        if not candidates:
            waits = [r.breaker.open_remaining for r in self.registry.replicas if r.breaker.state == STATE_OPEN]
            raise BackendUnavailable(f"model {model!r} has no live replica right now; retry shortly",
                                     retry_after=max(1.0, min(waits, default=1.0)))
        replica = None
        if prefix is not None and len(candidates) > 1:
            replica = self._by_prefix(candidates, prefix)
        if replica is None:
            replica = min(candidates, key=lambda r: (r.in_flight, r.picks))
        replica.picks += 1
        if prefix is not None:
            replica.prefixes.add(prefix)
        return replica

    def _by_prefix(self, candidates: list[Replica], prefix: Prefix) -> Replica | None:
        matched = {r: r.prefixes.matched(prefix) for r in candidates}
        best_match = max(matched.values())
        if best_match == 0:
            metrics.AFFINITY.labels("none").inc()
            return None
        cap = math.ceil(self.settings.affinity_load_factor * (sum(r.in_flight for r in candidates) + 1) / len(candidates))
        tokens = sum(r.tokens_in_flight for r in candidates) + prefix.tokens
        whole = 1 + len(prefix.blocks)

        def score(r: Replica) -> tuple:
            return (matched[r] / whole - self.settings.affinity_load_weight * r.tokens_in_flight / tokens,
                    -r.in_flight, -r.picks)

        under_cap = [r for r in candidates if r.in_flight < cap]
        replica = max(under_cap or candidates, key=score)
        metrics.AFFINITY.labels("preferred" if matched[replica] == best_match else "spilled").inc()
        return replica

    async def call(self, info: ModelInfo, fn: Callable[[Backend, ModelInfo], Awaitable[T]],
                   prefix: Prefix | None = None) -> T:
        """Run `fn(backend, model_info)` on the least busy live replica serving `info.name`, within the model's
        own concurrency limit if it has one. A failed connect is tried on the next replica; anything else is
        the answer. A Stream keeps its replica (and its slot) busy until closed. A model with no live replica left
        is answered by its fallbacks (settings.fallbacks), in order, before a stream has begun. `prefix`: see
        _pick."""
        public = self.rollout.watching.get(info.name)
        if public is not None:  # a model a promotion moves between: its figures, and the shadow's copy
            return await self._watched(public, info, fn, prefix)
        return await self._routed(info, fn, prefix)

    async def _routed(self, info: ModelInfo, fn: Callable[[Backend, ModelInfo], Awaitable[T]],
                      prefix: Prefix | None = None) -> T:
        chain = self.settings.fallbacks.get(info.name)
        if not chain:
            return await self._resident(info, fn, prefix)
        try:
            return await self._resident(info, fn, prefix)
        except BackendUnavailable as exc:
            for fallback in self._fallbacks(info.name, info.task, exc):
                with contextlib.suppress(BackendUnavailable):
                    return await self._resident(fallback, fn, prefix)
            raise

    async def _watched(self, public: str, info: ModelInfo, fn: Callable[[Backend, ModelInfo], Awaitable[T]],
                       prefix: Prefix | None) -> T:
        """`_routed`, timed and counted by the role of the model that answered (rtxserve_rollout_*); in the shadow step,
        a share of the current model's requests then sent again to the candidate (rollout/shadow.py)."""
        promotion = self.rollout.snapshot.promotions.get(public)
        role = "candidate" if promotion is not None and promotion.candidate == info.name else "current"
        started = time.perf_counter()
        try:
            result = await self._routed(info, fn, prefix)
        except BREAKS as exc:
            metrics.ROLLOUT_REQUESTS.labels(public, info.name, role, "error").inc()
            current = self.registry.models.get(promotion.current) if promotion is not None else None
            if role == "candidate" and isinstance(exc, BackendUnavailable) and current is not None and current.ready:
                # the candidate took nothing in (down, gone, refusing): the model it would replace answers instead,
                # while the promotion's figures count the failure that rolls it back
                log.warning("candidate %s of %s is unavailable (%s): %s answers", info.name, public, exc.message,
                            current.name)
                return await self._routed(current, fn, prefix)
            raise
        metrics.ROLLOUT_SECONDS.labels(public, info.name, role).observe(time.perf_counter() - started)
        metrics.ROLLOUT_REQUESTS.labels(public, info.name, role, "ok").inc()
        shadow = self.rollout.shadows.get(info.name)
        if shadow is not None and random.random() < shadow[1]:
            candidate = self.registry.models.get(shadow[0])
            if candidate is None or not candidate.ready:
                metrics.ROLLOUT_REQUESTS.labels(public, shadow[0], "shadow", "error").inc()
            else:
                task = asyncio.create_task(mirror(lambda: self._resident(candidate, fn), result, public, candidate.name))
                self._shadows.add(task)
                task.add_done_callback(self._shadows.discard)
        return result

    async def _resident(self, info: ModelInfo, fn: Callable[[Backend, ModelInfo], Awaitable[T]],
                        prefix: Prefix | None = None) -> T:
        """`_held`; rows of a model with an answer cache (answer_cache.py) are looked up in it first, under the model that
        answers: only those it lacks are called for."""
        if isinstance(fn, Rows) and info.name in self.answers:
            return await self.answers.rows(info.name, fn, lambda missing: self._held(info, missing))
        return await self._held(info, fn, prefix)

    async def _held(self, info: ModelInfo, fn: Callable[[Backend, ModelInfo], Awaitable[T]],
                    prefix: Prefix | None = None) -> T:
        """`_yielding`, with the model held loaded (an on-demand model: until a stream ends)."""
        owner = self.settings.on_demand_owner(info.name)
        if owner is None:
            return await self._yielding(info, fn, prefix)
        release = await self.residency.hold(owner)
        try:
            result = await self._yielding(info, fn, prefix)
        except BaseException:
            release()
            raise
        if isinstance(result, Stream):
            return _HeldStream(result, release)
        release()
        return result

    async def _yielding(self, info: ModelInfo, fn: Callable[[Backend, ModelInfo], Awaitable[T]],
                        prefix: Prefix | None = None) -> T:
        """`_gated`, a batch's request first waiting while people's requests to the same servers wait for their first
        token (yielding.py)."""
        if self.people is None:
            return await self._gated(info, fn, prefix)
        group = tuple(r.name for r in self.registry.replicas if info.name in r.models)
        person = CALLER_PRIORITY.get() < PRIORITIES["batch"]
        done = self.people.person(group) if person else await self.people.batch_turn(group)
        try:
            result = await self._gated(info, fn, prefix)
        except BaseException:
            done()
            raise
        if isinstance(result, Stream):  # a person's first token is its first chunk; a batch's request ends with it
            return _FirstChunk(result, done) if person else _HeldStream(result, done)
        done()
        return result

    async def _gated(self, info: ModelInfo, fn: Callable[[Backend, ModelInfo], Awaitable[T]],
                     prefix: Prefix | None = None) -> T:
        gate = self.gates.get(info.name)
        if gate is None:
            return await self._call(info, fn, prefix)
        await gate.acquire(CALLER_PRIORITY.get(), CALLER.get() or "")  # by the key's priority, keys in turn
        try:
            result = await self._call(info, fn, prefix)
        except BaseException:
            gate.release()
            raise
        if isinstance(result, Stream):
            return _HeldStream(result, gate.release)
        gate.release()
        return result

    async def _call(self, info: ModelInfo, fn: Callable[[Backend, ModelInfo], Awaitable[T]],
                    prefix: Prefix | None = None) -> T:
        first = self._pick(info.name, set(), prefix)
        try:
            return await self._run(first, info, fn, prefix)  # the hot path: no retry machinery unless it is needed
        except BackendConnectFailed:
            tried = {first}
            others = sum(1 for r in self.registry.replicas if r not in tried and r.serves(info.name))
            if not others:
                raise
        async for attempt in AsyncRetrying(retry=retry_if_exception_type(BackendConnectFailed),
                                           stop=stop_after_attempt(others), reraise=True):
            with attempt:
                replica = self._pick(info.name, tried, prefix)
                tried.add(replica)
                return await self._run(replica, info, fn, prefix)
        raise AssertionError("unreachable")  # AsyncRetrying either returns or re-raises

    async def _run(self, replica: Replica, info: ModelInfo, fn, prefix: Prefix | None = None) -> T:
        tokens = prefix.tokens if prefix is not None else 0
        replica.in_flight += 1
        replica.tokens_in_flight += tokens  # until the answer, or the stream, ends: the load the scorer sees now
        self.busy[info.name] += 1
        start = time.perf_counter()
        held = False

        def release() -> None:
            replica.in_flight -= 1
            replica.tokens_in_flight -= tokens
            self.busy[info.name] -= 1

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
