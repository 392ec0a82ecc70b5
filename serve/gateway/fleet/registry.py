"""What the gateway knows about its backend replicas: what each serves, whether it is up, and whether the gateway is
ready.

Each replica (one Triton server, one vLLM engine per GPU, ...) has its own health, in-flight count and circuit
breaker (the `circuitbreaker` library; dispatch.py opens and closes it). A background loop refreshes what every
replica serves every `health_interval_s`, so request handling and `/readyz` read memory instead of calling backends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace

from circuitbreaker import STATE_OPEN, CircuitBreaker

from core import contract

from .. import metrics
from ..backends.base import Backend, ModelInfo
from ..exceptions import BackendError, BackendTimeout, BackendUnavailable
from ..settings import Alias, GatewaySettings
from .prefix import PrefixIndex

log = logging.getLogger("rtxserve.gateway")
# What opens a replica's breaker: the backend failing, not the client's request being wrong.
BREAKS = (BackendUnavailable, BackendTimeout, BackendError)

# A model is ready only once it has answered one real request of its task (deep readiness): a model that loads
# but cannot infer must not take traffic. Each task declares its request beside its route (canaries.py lists them).
Canary = Callable[[Backend, ModelInfo, float], Awaitable[object]]


@dataclass(eq=False)
class Replica:
    backend: Backend
    breaker: CircuitBreaker
    up: bool = False
    in_flight: int = 0
    tokens_in_flight: int = 0  # generation requests' estimated prompt and output tokens (prefix.Prefix.tokens)
    picks: int = 0  # tie-break among equally busy replicas: round robin
    models: dict[str, ModelInfo] = field(default_factory=dict)
    canaried: set[str] = field(default_factory=set)  # models that answered their first request here
    last_ok: dict[str, float] = field(default_factory=dict)  # model -> when it last answered a request here
    prefixes: PrefixIndex = field(default_factory=lambda: PrefixIndex(50_000))  # what its prefix cache may hold

    @property
    def name(self) -> str:
        return self.backend.name

    def serves(self, model: str) -> bool:
        info = self.models.get(model)
        return self.up and info is not None and info.ready and self.breaker.state != STATE_OPEN


class Registry:
    """The replicas, the models they serve together (`models`: ready where one live replica serves it), and readiness."""

    def __init__(self, settings: GatewaySettings, backends: list[Backend], canaries: Mapping[str, Canary]):
        self.settings = settings
        self.canaries = canaries
        self.replicas = [
            Replica(b, CircuitBreaker(failure_threshold=settings.breaker_failures,
                                      recovery_timeout=settings.breaker_reset_s, expected_exception=BREAKS, name=b.name),
                    prefixes=PrefixIndex(settings.prefix_index_blocks))
            for b in backends
        ]
        self.models: dict[str, ModelInfo] = {}
        self.draining = False  # after SIGTERM: not ready, still serving (app.py)
        self.last_refresh = 0.0
        self.on_unready: list[Callable[[str], None]] = []  # told of each model that stops being ready (answer_cache.py)

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
        owners = {m.name: self.settings.on_demand_owner(m.name) for m in found if not m.task}
        # an on-demand model not loaded yet (or an adapter of one): its task is known from the settings
        found = [m if m.task else replace(m, task=self.settings.on_demand[owners[m.name]].task) for m in found
                 if m.task or owners[m.name]]
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
        was_ready = {n for n, m in self.models.items() if m.ready}
        self.models = {n: replace(m, ready=any(r.serves(n) for r in self.replicas)) for n, m in merged.items()}
        for name in was_ready - {n for n, m in self.models.items() if m.ready}:
            for tell in self.on_unready:
                tell(name)
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

    def ready(self, routes: Mapping[str, Alias] | None = None, retired: frozenset[str] = frozenset()) -> tuple[bool, dict]:
        """Ready when not draining and every required model (default: all known but the on-demand ones, loaded when
        asked for, and those a promotion `retired`) is served by a live replica; a required name a promotion routes
        (`routes`) is ready when the models it sends requests to are."""
        routes = routes or {}
        required = self.settings.required_models or [n for n in self.models if not self.settings.on_demand_owner(n)
                                                     and n not in retired]
        served_by = {n: [t for t, w in routes[n].targets.items() if w] if n in routes else [n] for n in required}
        missing = [n for n, targets in served_by.items()
                   if not all(t in self.models and self.models[t].ready for t in targets)]
        known = bool(required) or (bool(self.models) and all(r.up for r in self.replicas))  # every model on demand
        ok = not self.draining and known and not missing

        def replica_state(r: Replica) -> str:
            broken = sorted(n for n, m in r.models.items() if not m.ready) if r.up else []
            return (("up" if r.up else "down") + (", breaker open" if r.breaker.state == STATE_OPEN else "")
                    + (f", not ready: {', '.join(broken)}" if broken else ""))

        detail = {
            "backends": {r.name: replica_state(r) for r in self.replicas},
            "models": {n: ("not ready" if n in missing else "ready") for n in required},
        }
        if self.draining:
            detail["draining"] = True
        return ok, detail
