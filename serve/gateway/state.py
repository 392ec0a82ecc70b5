"""What the gateway knows about its backends: the models they serve and whether they are ready.

A background loop refreshes it every `health_interval_s`, so request handling and `/readyz` read
memory instead of calling the backends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

from ..backends.base import Backend, ModelInfo
from ..exceptions import BackendUnavailable, InvalidRequest, ModelNotFound
from ..settings import GatewaySettings
from .keys import KeyRing
from .quotas import Quotas

log = logging.getLogger("rtxserve.gateway")


class GatewayState:
    def __init__(self, settings: GatewaySettings, backends: list[Backend]):
        self.settings = settings
        self.backends = backends
        self.keys = KeyRing(settings.keys_file) if settings.keys_file else None
        self.quotas = Quotas(settings.rate_limit_storage or "async+memory://") if self.keys else None
        self.models: dict[str, tuple[ModelInfo, Backend]] = {}
        self.backend_up: dict[str, bool] = {b.kind: False for b in backends}
        self.last_refresh = 0.0

    async def refresh(self) -> None:
        models: dict[str, tuple[ModelInfo, Backend]] = {}
        for backend in self.backends:
            try:
                found = await backend.discover()
            except BackendUnavailable as exc:
                if self.backend_up.get(backend.kind):
                    log.warning("backend %s went down: %s", backend.kind, exc.message)
                self.backend_up[backend.kind] = False
                # Keep the models we knew, marked not ready: clients get 503, not 404, while it is down.
                models.update({n: (replace(m, ready=False), b) for n, (m, b) in self.models.items() if b is backend})
                continue
            if not self.backend_up.get(backend.kind):
                log.info("backend %s is up: %s", backend.kind, ", ".join(m.name for m in found) or "no models")
            self.backend_up[backend.kind] = True
            models.update({m.name: (m, backend) for m in found})
        self.models = models
        self.last_refresh = time.monotonic()

    async def run_health_loop(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # the loop must survive anything a backend does
                log.exception("health refresh failed")
            await asyncio.sleep(self.settings.health_interval_s)

    def ready(self) -> tuple[bool, dict]:
        """Ready when every backend is up and every required model (default: all known) is ready."""
        required = self.settings.required_models or list(self.models)
        missing = [n for n in required if n not in self.models or not self.models[n][0].ready]
        ok = all(self.backend_up.values()) and bool(required) and not missing
        detail = {
            "backends": {k: ("up" if v else "down") for k, v in self.backend_up.items()},
            "models": {n: ("ready" if n in self.models and self.models[n][0].ready else "not ready") for n in required},
        }
        return ok, detail

    def resolve(self, name: str, task: str | tuple[str, ...]) -> tuple[ModelInfo, Backend]:
        """The model and backend for a request (of one of the tasks `task` names), or the error the client should get."""
        if name not in self.models:
            if not all(self.backend_up.values()):
                raise BackendUnavailable(f"model {name!r} is unknown while a backend is down; retry shortly")
            raise ModelNotFound(f"model {name!r} does not exist; GET /v1/models lists the models", param="model")
        info, backend = self.models[name]
        tasks = (task,) if isinstance(task, str) else task
        if info.task not in tasks:
            raise InvalidRequest(f"model {name!r} is a {info.task} model, not {' or '.join(tasks)}", param="model")
        if not info.ready:
            raise BackendUnavailable(f"model {name!r} is not ready; retry shortly")
        return info, backend
