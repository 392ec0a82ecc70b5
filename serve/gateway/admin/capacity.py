"""The admin routes of live headroom (fleet/headroom.py): `rtxserve capacity --record` sends a model's confirmed
capacity here, with an admin key; `serve status` and operators read each model's, with the share used now."""

from __future__ import annotations

from fastapi import Depends, Request
from pydantic import BaseModel, ConfigDict, Field, StrictStr

from ..access.auth import authenticate
from ..edge.orjson_route import gateway_router
from ..exceptions import ERROR_RESPONSES, ModelNotFound
from .router import require_admin

router = gateway_router(tags=["admin"], dependencies=[Depends(authenticate), Depends(require_admin)],
                        responses=ERROR_RESPONSES)


class CapacityRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    requests_per_second: float = Field(gt=0, le=1e7, description="the most requests/s the model held within the SLO")
    slo: StrictStr = Field("", max_length=256, description="the SLO it held, as `rtxserve capacity --slo` gives it")
    how: StrictStr = Field("", max_length=1000, description="how it was measured (the scenario, the confirm runs)")


@router.get("/admin/capacity")
async def capacity(request: Request) -> dict:
    """Each recorded model's capacity, when and on which box it was measured, whether the box changed since (stale),
    and the share of it this worker's requests of the last seconds use."""
    headroom = request.app.state.gateway.headroom
    return {"box": headroom.box(), "models": headroom.status()}


@router.put("/admin/capacity/{model}")
async def record(model: str, body: CapacityRecord, request: Request) -> dict:
    """Keep `model`'s confirmed capacity (replacing the last), stamped with this box and the time."""
    state = request.app.state.gateway
    if model not in state.registry.models and model not in state.rollout.routes:
        raise ModelNotFound(f"no model {model!r} is served here", param="model")
    return state.headroom.record(model, body.requests_per_second, body.slo, body.how)
