"""Health, readiness, metrics and the model list."""

from fastapi import Depends, Request, Response
from fastapi.responses import JSONResponse

from ..auth import authenticate, request_key
from ..routing import gateway_router

from .. import metrics

router = gateway_router()


@router.get("/healthz", tags=["system"])
@router.get("/health", tags=["system"])
async def healthz() -> dict:
    """Liveness: the gateway process answers (`/health` too: vLLM's name, which guidellm and charts probe)."""
    return {"status": "ok"}


@router.get("/readyz", tags=["system"])
async def readyz(request: Request) -> JSONResponse:
    """Readiness: every backend is up and every required model is ready (503 otherwise)."""
    ok, detail = request.app.state.gateway.ready()
    return JSONResponse({"status": "ready" if ok else "not ready", **detail}, status_code=200 if ok else 503)


@router.get("/metrics", tags=["system"])
async def prometheus() -> Response:
    body, content_type = metrics.render()
    return Response(body, media_type=content_type)


@router.get("/v1/models", tags=["models"], dependencies=[Depends(authenticate)])
async def list_models(request: Request) -> dict:
    """OpenAI-shaped model list, with each model's task and readiness: the models the request's key may use."""
    state, key = request.app.state.gateway, request_key(request)
    data = [
        {"id": info.name, "object": "model", "created": 0, "owned_by": "rtxserve",
         "task": info.task, "backend": info.backend, "ready": info.ready}
        for info in sorted(state.models.values(), key=lambda m: m.name)
        if key is None or key.allows(info.name)
    ]
    return {"object": "list", "data": data}
