"""The gateway's state, one part per job:
- `registry` (fleet/registry.py): the backend replicas, what each serves and whether it is up, canaries, readiness;
- `dispatch` (fleet/dispatch.py): the model a request names (aliases, fallbacks), the replica that takes it, per-model
  gates, retries and breakers;
- `residency` (fleet/residency.py): the on-demand models, loaded when asked for and unloaded when idle or to make room
  (fleet/decider.py: by one gateway for all, where several share `residency_store_url`);
- `rollout` (rollout/): the routes promotions changed at run time, their shadows, and the models they pinned or retired;
- `access` (access/caller.py): the API keys and their quotas;
- `batches` (batches/runner.py): the Files and Batch APIs' store and the runner of the batches, where `batch_dir`
  is set;
- `headroom` (fleet/headroom.py): each model's confirmed capacity and the share of it today's traffic uses.

One is made per gateway worker (app.py) and reached by the routes as `request.app.state.gateway`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import BaseModel

from .access.caller import Access
from .backends.base import Backend
from .batches.runner import BatchRunner
from .fleet.decider import Decider
from .fleet.dispatch import Dispatcher
from .fleet.headroom import Headroom
from .fleet.registry import Canary, Registry
from .fleet.residency import Residency
from .fleet.rollout.retire import retirer
from .fleet.rollout.table import Rollout
from .settings import GatewaySettings


@dataclass(frozen=True)
class GatewayState:
    settings: GatewaySettings
    registry: Registry
    residency: Residency
    rollout: Rollout
    dispatch: Dispatcher
    access: Access
    headroom: Headroom
    batches: BatchRunner | None = None

    @classmethod
    def build(cls, settings: GatewaySettings, backends: list[Backend], canaries: Mapping[str, Canary],
              batch_endpoints: Mapping[str, type[BaseModel]] | None = None) -> GatewayState:
        """`batch_endpoints`: the routes a batch may run -> the request type each accepts."""
        registry = Registry(settings, backends, canaries)
        rollout = Rollout(settings)
        url, password = settings.residency_store()
        residency = (Decider(settings, registry, url, password, pinned=lambda: rollout.pinned)
                     if url and settings.on_demand else Residency(settings, registry, pinned=lambda: rollout.pinned))
        dispatch = Dispatcher(settings, registry, residency, rollout)
        rollout.retire = retirer(registry, residency, busy=lambda model: dispatch.busy[model])
        access = Access(settings)
        batches = BatchRunner(settings, access, batch_endpoints or {}) if settings.batch_dir or settings.batch_store_url else None
        return cls(settings, registry, residency, rollout, dispatch, access, Headroom(settings, registry), batches)
