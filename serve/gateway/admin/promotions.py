"""The admin routes of a promotion (rollout/): `rtxserve promote` drives its steps through them, on a box or a fleet,
with an admin key. A step answers the promotion as it stands after it; every step renews the promotion's lease, which
ends it (rolled back before the switch, finished after) when its driver stops."""

from __future__ import annotations

from typing import Literal

from fastapi import Depends, Request
from pydantic import BaseModel, ConfigDict, Field, StrictStr

from ..access.auth import authenticate
from ..edge.orjson_route import gateway_router
from ..exceptions import ERROR_RESPONSES, BackendUnavailable, Conflict, InvalidRequest, ModelNotFound, NotFound
from ..fleet.rollout.store import RolloutError
from ..fleet.rollout.table import PromotionConflict, PromotionNotFound
from ..state import GatewayState
from .router import require_admin

router = gateway_router(tags=["admin"], dependencies=[Depends(authenticate), Depends(require_admin)],
                        responses={**ERROR_RESPONSES, 409: {"model": ERROR_RESPONSES[400]["model"],
                                                            "description": "a promotion runs, or it cannot take that step"}})
LEASE_S = Field(30.0, gt=0, le=3600, description="seconds until the promotion ends unless renewed (rolled back "
                "before its switch, finished after)")


class PromotionStart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: StrictStr = Field(min_length=1, max_length=256, description="the name clients call")
    candidate: StrictStr = Field(min_length=1, max_length=256, description="the served model to put in front of it")
    lease_s: float = LEASE_S


class PromotionStep(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: StrictStr
    phase: Literal["started", "shadow", "canary", "switched"]
    weight: int = Field(0, ge=0, le=100, description="canary: the candidate's share of the requests, percent")
    shadow: float = Field(0.0, ge=0.0, le=1.0, description="shadow: the share of the requests copied to the candidate")
    lease_s: float = LEASE_S


class PromotionEnd(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: StrictStr | None = None
    reason: StrictStr | None = Field(None, max_length=1000)


def _current(state: GatewayState, model: str) -> str:
    """The one model serving `model` now: itself, or the single target of its route."""
    route = state.rollout.routes.get(model)
    if route is None:
        if model not in state.registry.models or model in state.rollout.retired:
            raise ModelNotFound(f"no model {model!r} is served here", param="model")
        return model
    targets = [t for t, w in route.targets.items() if w]
    if len(targets) != 1:
        split = ", ".join(f"{t} ({w} %)" for t, w in route.targets.items())
        raise Conflict(f"{model} is split between {split}: a promotion moves a name from one model to another")
    return targets[0]


def _same_kind(state: GatewayState, current: str, candidate: str) -> None:
    """A candidate of another task or other labels than the current model is refused, naming the difference."""
    info = state.registry.models.get(candidate)
    if info is None or candidate in state.rollout.retired:
        raise ModelNotFound(f"no model {candidate!r} is served here: export it and add it to the box first",
                            param="candidate")
    now = state.registry.models[current]
    if info.task != now.task:
        raise InvalidRequest(f"{candidate} is a {info.task} model and {current} a {now.task} one: a promotion replaces "
                             "a model with one of the same task", param="candidate")
    if info.labels and now.labels and info.labels != now.labels:
        added, gone = sorted(set(info.labels) - set(now.labels)), sorted(set(now.labels) - set(info.labels))
        what = (f"labels {', '.join(gone)} gone, {', '.join(added)} added" if added or gone
                else f"the same labels in another order ({', '.join(info.labels)} against {', '.join(now.labels)})")
        raise InvalidRequest(f"{candidate} does not label as {current} does: {what}", param="candidate")


def _refusal(exc: PromotionConflict) -> Exception:
    """404 where no such promotion runs, else 409."""
    return NotFound(str(exc)) if isinstance(exc, PromotionNotFound) else Conflict(str(exc))


def _conflict(call):
    try:
        return call()
    except PromotionConflict as exc:
        raise _refusal(exc) from None
    except RolloutError as exc:
        raise BackendUnavailable(str(exc)) from None


@router.get("/admin/promotions")
async def promotions(request: Request) -> dict:
    """The routes (the settings' aliases, and those promotions made), the models promotions retired, the promotions
    running and the last that ended."""
    rollout = request.app.state.gateway.rollout
    snapshot = rollout.snapshot
    return {"routes": {n: r.targets for n, r in rollout.routes.items()}, "retired": snapshot.retired,
            "promotions": [p.model_dump() for p in snapshot.promotions.values()],
            "history": [p.model_dump() for p in snapshot.history]}


@router.post("/admin/promotions", status_code=201)
async def begin(body: PromotionStart, request: Request) -> dict:
    """Begin promoting `candidate` in front of what serves `model`: nothing changes for clients yet."""
    state: GatewayState = request.app.state.gateway
    if not state.settings.promotions:
        raise Conflict("promotions are off on this gateway: its replicas do not share one state (Kubernetes' gateway "
                       "pods; see the docs' shipping page)")
    current = _current(state, body.model)
    if body.candidate == current:
        raise InvalidRequest(f"{body.candidate} already serves {body.model}", param="candidate")
    _same_kind(state, current, body.candidate)
    return _conflict(lambda: state.rollout.begin(body.model, current, body.candidate, body.lease_s)).model_dump()


@router.patch("/admin/promotions/{model}")
async def step(model: str, body: PromotionStep, request: Request) -> dict:
    """The promotion's next step (or the same again: its lease renewed)."""
    rollout = request.app.state.gateway.rollout
    return _conflict(lambda: rollout.step(model, body.id, phase=body.phase, weight=body.weight, shadow=body.shadow,
                                          lease_s=body.lease_s)).model_dump()


@router.post("/admin/promotions/{model}/rollback")
async def rollback(model: str, body: PromotionEnd, request: Request) -> dict:
    """Back to the route the promotion found, from any step before it finished."""
    rollout = request.app.state.gateway.rollout
    return _conflict(lambda: rollout.rollback(model, body.id, body.reason or "rolled back by hand")).model_dump()


@router.post("/admin/promotions/{model}/finish")
async def finish(model: str, body: PromotionEnd, request: Request) -> dict:
    """A switched promotion made final: the model it replaced unloaded where its backend can."""
    rollout = request.app.state.gateway.rollout
    try:
        promotion = await rollout.finish(model, body.id, body.reason or "finished")
    except PromotionConflict as exc:
        raise _refusal(exc) from None
    return promotion.model_dump()


@router.post("/admin/models/{name}/load")
async def load(name: str, request: Request) -> dict:
    """Load a model kept on demand (a candidate, into the swap room), waiting for it as a request would."""
    state: GatewayState = request.app.state.gateway
    owner = state.settings.on_demand_owner(name)
    if name not in state.registry.models:
        raise ModelNotFound(f"no model {name!r} is served here", param="name")
    if owner is not None:
        await state.residency.ensure(owner)
    info = state.registry.models[name]
    if not info.ready:
        raise BackendUnavailable(f"{name} is not ready", retry_after=2.0)
    return {"name": name, "ready": True, "on_demand": owner is not None}
