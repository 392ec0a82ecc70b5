"""On-demand models: loaded when a request first asks for one, unloaded when idle or when another needs the room.

The settings name them (`on_demand`: task, planned GiB, idle_unload_s) and the room they share (`swap_room_gib`, the
plan's swap room). A request for one that is not loaded starts its load, or joins the load already under way (one
load however many requests arrive at once), and waits for it up to `load_wait_s`; then it gets 503 with Retry-After
while the load goes on, and later requests find the model ready. Before a load, the least recently used idle
on-demand models are unloaded until the new one fits; a model with requests in flight here (streams until they end)
is never picked, and the load waits for one to finish instead. A load that fails is answered 503 naming it, and the
next request tries again after a backoff (`load_retry_s`, doubled per failure up to 60 s).

It works through the backend's capability (`Backend.swaps`, `load`, `unload`): Triton's repository API in explicit
model-control mode, and vLLM's sleep API (`/wake_up`, `/sleep`: vLLM's own on a GPU, serve/engine_control.py's on a
CPU). An adapter loads with its engine's model (`GatewaySettings.on_demand_owner`). This gateway decides alone; several
gateways (a box's workers, a fleet's pods) leave the deciding to one of them (decider.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable

import tenacity

from .. import metrics
from ..exceptions import BackendUnavailable, GatewayError
from ..settings import GatewaySettings
from .registry import Registry

log = logging.getLogger("rtxserve.gateway.residency")
MAX_RETRY_S = 60.0
# How long a model just loaded has to answer its first request (the registry's canary, one check a second). One check
# is not enough on a busy box: a CPU engine that has just started can miss the registry's 2 s discovery once.
FIRST_ANSWER_S = 30.0


def _noop() -> None:
    pass


class Residency:
    def __init__(self, settings: GatewaySettings, registry: Registry,
                 pinned: Callable[[], frozenset[str]] = lambda: frozenset()):
        """`pinned`: the models never unloaded to make room or when idle (a promotion's, rollout/table.py)."""
        self.settings, self.registry, self.pinned = settings, registry, pinned
        self.models = settings.on_demand
        self.in_flight: Counter[str] = Counter()
        self.waiting: Counter[str] = Counter()  # requests waiting for their model's load
        self.last_used: dict[str, float] = {}
        self._loads: dict[str, asyncio.Task] = {}
        self._unloading: set[str] = set()
        self._loading: set[str] = set()  # room made, load under way
        self._no_room: dict[str, str] = {}  # model -> why its load is waiting: the room is held by busy models
        self._failures: dict[str, tuple[int, float, str]] = {}  # model -> (failures in a row, retry after, why)
        self._lock: asyncio.Lock | None = None  # room made, or an unload, one at a time (made inside the event loop)
        self._released: asyncio.Event | None = None  # set when a model's last request here ends

    # ------------------------------------------------------------------------------------------- what is loaded

    def serving(self, name: str) -> bool:
        """Served by a live replica, as the registry last saw the backends."""
        info = self.registry.models.get(name)
        return info is not None and info.ready

    def loaded(self, name: str) -> bool:
        """Served by a live replica and not being unloaded: a request may start on it."""
        return self.serving(name) and name not in self._unloading

    def resident(self) -> list[str]:
        """The on-demand models loaded now, least recently used first."""
        now = time.monotonic()
        here = [n for n in self.models if self.serving(n) and n not in self._unloading]
        for name in here:  # one loaded before this worker saw it (at start, or by another worker): from now
            self.last_used.setdefault(name, now)
        return sorted(here, key=lambda n: self.last_used[n])

    def used_gib(self, leaving_out: str = "") -> float:
        """The room the loaded models and those being loaded take."""
        return sum(self.models[n].gib for n in {*self.resident(), *self._loading} if n != leaving_out)

    # ------------------------------------------------------------------------------------------- requests

    async def hold(self, name: str) -> Callable[[], None]:
        """Make sure `name` is loaded (loading it if it is on demand) and count a request on it until the returned
        release is called: a model with requests in flight is never unloaded."""
        if name not in self.models:
            return _noop
        while not self.loaded(name):
            await self.ensure(name)
        self.in_flight[name] += 1
        self.last_used[name] = time.monotonic()

        def release() -> None:
            self.in_flight[name] -= 1
            self.last_used[name] = time.monotonic()
            if self.in_flight[name] <= 0 and self._released is not None:
                self._released.set()

        return release

    async def ensure(self, name: str) -> None:
        """Return once `name` is loaded: start its load or join the one under way, for up to load_wait_s."""
        if name not in self.models or self.loaded(name):
            return
        failures, retry_at, why = self._failures.get(name, (0, 0.0, ""))
        now = time.monotonic()
        if retry_at > now:
            metrics.LOAD_WAITS.labels(name, "failed").inc()
            raise BackendUnavailable(f"model {name!r} could not be loaded ({why}); the next try is in "
                                     f"{retry_at - now:.1f} s", retry_after=retry_at - now)
        task = self._loads.get(name)
        if task is None:
            task = self._loads[name] = asyncio.create_task(self._load(name))
            task.add_done_callback(lambda t, name=name: self._load_done(name, t))
        try:
            with self._waiting(name):
                await asyncio.wait_for(asyncio.shield(task), self.settings.load_wait_s)
        except TimeoutError:
            metrics.LOAD_WAITS.labels(name, "timeout").inc()
            why = self._no_room.get(name) or f"is still loading after {self.settings.load_wait_s:g} s"
            raise BackendUnavailable(f"model {name!r} {why}; retry shortly",
                                     retry_after=self.settings.load_wait_s) from None
        except GatewayError:
            metrics.LOAD_WAITS.labels(name, "failed").inc()
            raise
        metrics.LOAD_WAITS.labels(name, "served").inc()

    @contextlib.contextmanager
    def _waiting(self, name: str):
        self.waiting[name] += 1
        try:
            yield
        finally:
            self.waiting[name] -= 1

    def _load_done(self, name: str, task: asyncio.Task) -> None:
        self._loads.pop(name, None)
        if not task.cancelled():
            task.exception()  # retrieved here too: nobody may be waiting any more

    # ------------------------------------------------------------------------------------------- loads

    async def _load(self, name: str) -> None:
        async with self._one_at_a_time():  # room is made one load at a time; the loads themselves then overlap
            if self.loaded(name):  # another worker's load, seen by the last refresh
                return
            await self._make_room(name)
            replicas = [r for r in self.registry.replicas if r.up and r.backend.swaps and name in r.models]
            if not replicas:
                raise BackendUnavailable(f"model {name!r} has no live backend that can load it; retry shortly")
            self._loading.add(name)  # its room is taken from here
        try:
            await self._load_on(name, replicas)
        finally:
            self._loading.discard(name)

    async def _load_on(self, name: str, replicas: list) -> None:
        started = time.perf_counter()
        log.info("loading model %s (%.2f GiB; on-demand models loaded: %s)", name, self.models[name].gib,
                 ", ".join(self.resident()) or "none")
        try:
            results = await asyncio.gather(*(r.backend.load(name, self.settings.load_timeout_s) for r in replicas),
                                           return_exceptions=True)
            failed = next((e for e in results if isinstance(e, BaseException)), None)
            if failed is not None:
                raise failed
            if not await self._answers(name):
                raise BackendUnavailable(f"model {name!r} loaded but did not answer its first request within "
                                         f"{FIRST_ANSWER_S:g} s")
        except GatewayError as exc:
            self._failed(name, exc.message)
            raise BackendUnavailable(f"model {name!r} could not be loaded: {exc.message}",
                                     retry_after=self._failures[name][1] - time.monotonic()) from None
        took = time.perf_counter() - started
        self._failures.pop(name, None)
        self.last_used[name] = time.monotonic()
        metrics.MODEL_LOADS.labels(name, "loaded").inc()
        metrics.MODEL_LOAD_SECONDS.labels(name).observe(took)
        metrics.MODEL_RESIDENT.labels(name).set(1)
        log.info("model %s loaded in %.2f s", name, took)

    async def _answers(self, name: str) -> bool:
        """Whether `name`, just loaded, is served: what the backends serve now and the model's first request (the
        registry's canary), checked again each second until it answers or FIRST_ANSWER_S pass."""
        async def refreshed() -> bool:
            await self.registry.refresh()
            return self.serving(name)

        return await tenacity.AsyncRetrying(stop=tenacity.stop_after_delay(FIRST_ANSWER_S), wait=tenacity.wait_fixed(1.0),
                                            retry=tenacity.retry_if_result(lambda answered: not answered),
                                            retry_error_callback=lambda _: False)(refreshed)

    def _one_at_a_time(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock, self._released = asyncio.Lock(), asyncio.Event()
        return self._lock

    def _failed(self, name: str, why: str) -> None:
        failures = self._failures.get(name, (0, 0.0, ""))[0] + 1
        wait = min(MAX_RETRY_S, self.settings.load_retry_s * 2 ** (failures - 1))
        self._failures[name] = (failures, time.monotonic() + wait, why)
        metrics.MODEL_LOADS.labels(name, "failed").inc()
        log.error("model %s could not be loaded (%s); next try in %.1f s", name, why, wait)

    async def _make_room(self, name: str) -> None:
        """Unload the least recently used idle on-demand models until `name` fits in swap_room_gib; wait (up to
        load_wait_s) for one to go idle where every candidate has requests in flight."""
        room, need = self.settings.swap_room_gib, self.models[name].gib
        deadline = time.monotonic() + self.settings.load_wait_s
        while self.used_gib(leaving_out=name) + need > room + 1e-9:
            pinned = self.pinned()
            idle = [n for n in self.resident() if n != name and self.in_flight[n] <= 0 and n not in pinned]
            if idle:
                await self._unload(idle[0], "room")
                continue
            self._released.clear()
            why = (f"needs {need:g} GiB and the on-demand room ({room:g} GiB) is held by models serving requests "
                   f"({', '.join(self.resident())})")
            self._no_room[name] = why
            try:
                await asyncio.wait_for(self._released.wait(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise BackendUnavailable(f"model {name!r} {why}; retry shortly",
                                         retry_after=self.settings.load_wait_s) from None
            finally:
                self._no_room.pop(name, None)

    async def unload(self, name: str, reason: str) -> str:
        """Unload `name` (an on-demand model) once its requests here have ended, as room-making does: what was done."""
        async with self._one_at_a_time():
            deadline = time.monotonic() + self.settings.load_wait_s
            while self.in_flight[name] > 0 and time.monotonic() < deadline:
                self._released.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._released.wait(), max(0.0, deadline - time.monotonic()))
            if self.loaded(name):
                await self._unload(name, reason)
        return "unloaded (on demand)"

    async def _unload(self, name: str, reason: str) -> None:
        self._unloading.add(name)  # at once: no request starts on it from here
        log.info("unloading model %s (%s)", name, reason)
        started = time.perf_counter()
        try:
            replicas = [r for r in self.registry.replicas if r.up and r.backend.swaps and name in r.models]
            await asyncio.gather(*(r.backend.unload(name) for r in replicas))
            await self.registry.refresh()
        except GatewayError as exc:
            log.error("model %s could not be unloaded: %s", name, exc.message)
            return
        finally:
            self._unloading.discard(name)
        metrics.MODEL_UNLOADS.labels(name, reason).inc()
        metrics.MODEL_UNLOAD_SECONDS.labels(name).observe(time.perf_counter() - started)
        metrics.MODEL_RESIDENT.labels(name).set(0)

    # ------------------------------------------------------------------------------------------- idle models

    async def run(self) -> None:
        """Unload each on-demand model idle for its idle_unload_s (checked a few times per the shortest of them)."""
        idle_after = [m.idle_unload_s for m in self.models.values() if m.idle_unload_s]
        if not idle_after:
            return
        every = min(30.0, max(0.2, min(idle_after) / 4))
        while True:
            await asyncio.sleep(every)
            try:
                await self.unload_idle()
            except Exception:  # the loop must survive anything a backend does
                log.exception("idle unload failed")

    async def unload_idle(self) -> None:
        now, pinned = time.monotonic(), self.pinned()
        for name in self.resident():
            if name in pinned:
                continue
            after = self.models[name].idle_unload_s
            if after and self.in_flight[name] <= 0 and now - self.last_used[name] >= after:
                async with self._one_at_a_time():
                    if self.in_flight[name] <= 0 and self.loaded(name) and \
                            time.monotonic() - self.last_used[name] >= after:
                        await self._unload(name, "idle")

    def status(self) -> dict:
        """What `serve status` and /v1/models show: each on-demand model's state, GiB and requests in flight."""
        self.resident()
        return {n: {"state": "loading" if n in self._loads else "unloading" if n in self._unloading
                    else "loaded" if self.loaded(n) else "unloaded",
                    "gib": m.gib, "in_flight": self.in_flight[n], "waiting": self.waiting[n],
                    "idle_unload_s": m.idle_unload_s}
                for n, m in self.models.items()}
