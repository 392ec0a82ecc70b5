"""The gateway's own admin routes, for admin keys only: LoRA adapters loaded into, and unloaded from, every vLLM
replica of a base model while it serves (serve/lora_runtime.py: on every replica or on none), where the box's CLI
(`rtxserve adapters add|remove`, which also writes the deployment file) cannot reach the engines, as in a fleet.

The adapter's path is where the engines see it (their model volume); vLLM checks it against the base and the ranks it
was started for, and its refusal comes back as a 400 naming the replica. A gateway without keys has no admin routes
(403): anyone could otherwise load weights into its engines.
"""

from __future__ import annotations

import asyncio

from fastapi import Depends, Request
from pydantic import BaseModel, ConfigDict, Field, StrictStr

from core.contract import TEXT_GENERATION
from serve.lora_runtime import RuntimeLoraError, load_everywhere, unload_everywhere

from ..access.auth import authenticate, request_key
from ..edge.orjson_route import gateway_router
from ..exceptions import BackendUnavailable, Forbidden, InvalidRequest, ModelNotFound
from ..state import GatewayState


async def require_admin(request: Request) -> None:
    key = request_key(request)
    if request.app.state.gateway.access.keys is None:
        raise Forbidden("this gateway has no API keys, so no admin routes: serve it with a keys file and an admin key "
                        "(`rtxserve keys create --admin`), or use `rtxserve adapters` on the box")
    if key is None or not key.admin:
        raise Forbidden("only an admin key may load or unload adapters")


router = gateway_router(tags=["admin"], dependencies=[Depends(authenticate), Depends(require_admin)])


class AdapterLoad(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: StrictStr = Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
    path: StrictStr = Field(min_length=1, max_length=4096, description="the adapter folder, as the engines see it")
    base: StrictStr = Field(min_length=1, max_length=256, description="the served base model it is for")


def _engines(state: GatewayState, model: str) -> list[str]:
    """The URLs of the vLLM replicas that list `model`: all of them up (an adapter goes on every replica or none), else
    503."""
    replicas = [r for r in state.registry.replicas if r.backend.kind == "vllm" and model in r.models]
    down = [r.name for r in replicas if not r.up]
    if down:
        raise BackendUnavailable(f"replica {', '.join(down)} of {model} is down; an adapter goes on every replica or on "
                                 "none: try again when it is up")
    return [r.backend.url for r in replicas]


@router.post("/admin/adapters")
async def load_adapter(body: AdapterLoad, request: Request) -> dict:
    """Load a LoRA adapter on every replica of its base; listed in /v1/models when this answers."""
    state: GatewayState = request.app.state.gateway
    if body.name in state.registry.models or state.rollout.serves(body.name):
        raise InvalidRequest(f"{body.name} is already served; pick another name, or unload it first", param="name")
    base = state.registry.models.get(body.base)
    if base is None:
        raise ModelNotFound(f"no model {body.base!r} is served here", param="base")
    if base.task != TEXT_GENERATION:
        raise InvalidRequest(f"{body.base} is a {base.task} model: adapters are for LLMs", param="base")
    urls = _engines(state, body.base)
    try:
        await asyncio.to_thread(load_everywhere, urls, body.name, body.path)
    except RuntimeLoraError as exc:
        raise InvalidRequest(str(exc), param="path") from None
    await state.registry.refresh()
    return {"name": body.name, "base": body.base, "replicas": len(urls)}


@router.delete("/admin/adapters/{name}")
async def unload_adapter(name: str, request: Request) -> dict:
    """Unload a LoRA adapter from every replica that serves it."""
    state: GatewayState = request.app.state.gateway
    info = state.registry.models.get(name)
    # vLLM lists an adapter with its base's name as `parent` (a base model: its own path)
    if info is None or info.task != TEXT_GENERATION or info.extra.get("parent") not in state.registry.models:
        raise ModelNotFound(f"no adapter {name!r} is served here", param="name")
    urls = _engines(state, name)
    try:
        await asyncio.to_thread(unload_everywhere, urls, name)
    except RuntimeLoraError as exc:
        raise InvalidRequest(str(exc), param="name") from None
    await state.registry.refresh()
    return {"name": name, "replicas": len(urls)}
