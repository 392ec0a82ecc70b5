"""Who may call what: the API key of a request (a route dependency) and the models it may use.

With no keys file the gateway runs open (the settings allow that on loopback only); with one, every
model route needs `Authorization: Bearer <key>` (what the `openai` SDK sends as its `api_key`).
Health, readiness and metrics stay open for probes and Prometheus.
"""

from __future__ import annotations

from fastapi import Request

from .exceptions import Forbidden, Unauthenticated
from .keys import ApiKey


async def authenticate(request: Request) -> None:
    """Route dependency: 401 unless the request carries a valid key (when the gateway has keys)."""
    ring = request.app.state.gateway.keys
    if ring is None:
        return
    scheme, _, secret = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise Unauthenticated("missing API key: send the header 'Authorization: Bearer <key>'")
    key = ring.lookup(secret.strip())
    if key is None:
        raise Unauthenticated("invalid API key")  # never echo what was sent
    request.state.api_key = key


def request_key(request: Request) -> ApiKey | None:
    return getattr(request.state, "api_key", None)


async def admit(request: Request, model: str) -> None:
    """403 when the request's key may not use `model` (whether or not it exists: no probing by 403/404),
    429 when its quota is spent; names the model in the metrics labels once it is known."""
    state, key = request.app.state.gateway, request_key(request)
    request.state.model = model if model in state.models else ""
    if key is None:
        return
    if not key.allows(model):
        raise Forbidden(f"this API key may not use model {model!r}", param="model")
    await state.quotas.admit(key)
