"""Health, readiness, metrics and the model list."""

from fastapi import Depends, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel

from .. import metrics
from ..access.auth import authenticate, request_key
from ..edge.orjson_route import gateway_router

probes = gateway_router(tags=["system"], responses={})  # probes answer 200 (or readyz 503), nothing else
router = gateway_router()


class Readiness(BaseModel):
    status: str
    backends: dict[str, str]
    models: dict[str, str]
    on_demand: dict[str, str] = {}  # each on-demand model's residency: loaded, loading, unloading or unloaded
    draining: bool = False


@probes.get("/healthz")
@probes.get("/health")
async def healthz() -> dict:
    """Liveness: the gateway process answers (`/health` too: vLLM's name, which guidellm and charts probe)."""
    return {"status": "ok"}


@probes.get("/readyz", responses={200: {"model": Readiness}, 503: {"model": Readiness, "description": "not ready"}})
async def readyz(request: Request) -> JSONResponse:
    """Readiness: every backend is up and every required model is ready (503 otherwise); and what of the on-demand
    models is loaded (`rtxserve serve status` shows it)."""
    state = request.app.state.gateway
    ok, detail = state.registry.ready(state.rollout.routes, state.rollout.retired)
    if state.residency.models:
        detail["on_demand"] = {name: s["state"] for name, s in state.residency.status().items()}
    return JSONResponse({"status": "ready" if ok else "not ready", **detail}, status_code=200 if ok else 503)


@probes.get("/metrics", response_class=PlainTextResponse)
async def prometheus(request: Request) -> Response:
    body, content_type = metrics.render(request.app.state.gateway.settings.restarts_file)
    return Response(body, media_type=content_type)


@router.get("/v1/models", tags=["models"], dependencies=[Depends(authenticate)])
async def list_models(request: Request) -> dict:
    """OpenAI-shaped model list, with each model's task and readiness: the models the request's key may use (an
    on-demand one with its residency: loaded, loading, unloading or unloaded, its GiB and requests in flight; an
    engine's with its context, `max_model_len`, as vLLM lists it), and the
    aliases (settings.aliases, and the names promotions route) whose targets are known, with their weights; an alias is
    ready when a target is. A model a promotion replaced is not listed: its name is now the route's."""
    state, key = request.app.state.gateway, request_key(request)
    on_demand = state.residency.status()
    routes = state.rollout.routes
    data = [
        {"id": info.name, "object": "model", "created": 0, "owned_by": "rtxserve",
         "task": info.task, "backend": info.backend, "ready": info.ready}
        | ({"on_demand": on_demand[info.name]} if info.name in on_demand else {})
        | ({"max_model_len": info.extra["max_model_len"]} if info.extra.get("max_model_len") else {})
        for info in sorted(state.registry.models.values(), key=lambda m: m.name)
        if (key is None or key.allows(info.name)) and info.name not in routes and info.name not in state.rollout.retired
    ]
    for name, alias in sorted(routes.items()):
        targets = [state.registry.models[t] for t in alias.targets if t in state.registry.models]
        if targets and (key is None or key.allows(name)):
            data.append({"id": name, "object": "model", "created": 0, "owned_by": "rtxserve", "task": targets[0].task,
                         "backend": "alias", "ready": any(t.ready for t in targets), "alias_of": alias.targets})
    return {"object": "list", "data": data}
