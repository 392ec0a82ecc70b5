"""What a finished promotion does with the model it replaced: unloads it where its backend can, once the requests it
still answers here (streams until they end) are over. An on-demand model leaves the swap room; a Triton entry is
unloaded through the repository API (Triton answers what it runs first; a server that runs every entry without model
control refuses, and the entry stays loaded until the next start leaves it out); a LoRA adapter leaves every vLLM
engine of its base. A whole engine serving only the replaced model stays up: stopping it is the box's business."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from serve.lora_runtime import RuntimeLoraError, unload_everywhere

from ...exceptions import GatewayError
from ..registry import Registry
from ..residency import Residency

log = logging.getLogger("rtxserve.gateway.rollout")
DRAIN_S = 600.0  # the longest a retired model's last requests (a long stream) are waited for before it is unloaded


def retirer(registry: Registry, residency: Residency,
            busy: Callable[[str], int]) -> Callable[[str], Awaitable[str]]:
    """The rollout's `retire(model) -> what was done`; `busy(model)`: its requests in flight in this worker."""

    async def retire(name: str) -> str:
        deadline = time.monotonic() + DRAIN_S
        while busy(name) > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        owner = registry.settings.on_demand_owner(name)
        if owner == name:
            return await residency.unload(name, "retired")
        info = registry.models.get(name)
        if info is None or not info.ready:
            return "was not loaded"
        replicas = [r for r in registry.replicas if r.up and name in r.models]
        try:
            if info.backend == "vllm" and info.extra.get("parent") in registry.models:  # a LoRA adapter
                await asyncio.to_thread(unload_everywhere, [r.backend.url for r in replicas], name)
            elif info.backend == "triton" and replicas and all(r.backend.swaps for r in replicas):
                await asyncio.gather(*(r.backend.unload(name) for r in replicas))
            elif info.backend == "triton":
                return "left loaded: its server does not unload models"
            else:
                return "left loaded: its engine serves it alone (stop the engine to free it)"
        except (GatewayError, RuntimeLoraError) as exc:
            why = getattr(exc, "message", str(exc))
            log.warning("%s stays loaded: %s", name, why)
            return f"left loaded ({why}); the next start of the box leaves it out"
        await registry.refresh()
        return "unloaded"

    return retire
