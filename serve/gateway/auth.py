"""Who may call what: the API key of a request (a route dependency) and the models it may use.

With no keys file the gateway runs open (the settings allow that on loopback only); with one, every
model route needs `Authorization: Bearer <key>` (what the `openai` SDK sends as its `api_key`) or `x-api-key: <key>`
(what the `anthropic` SDK sends).
Health, readiness and metrics stay open for probes and Prometheus.
"""

from __future__ import annotations

from fastapi import Request

from .exceptions import Forbidden, Unauthenticated
from .keys import ApiKey
from .state import CALLER


def key_of(state, authorization: str, api_key: str = "") -> ApiKey | None:
    """The key an `Authorization: Bearer` header names, else an `x-api-key` header: None when the gateway has no
    keys; 401 when it has and the headers do not name one of them."""
    ring = state.keys
    if ring is None:
        return None
    scheme, _, secret = authorization.partition(" ")
    if not authorization and api_key.strip():
        scheme, secret = "bearer", api_key
    if scheme.lower() != "bearer" or not secret.strip():
        raise Unauthenticated("missing API key: send the header 'Authorization: Bearer <key>' (or 'x-api-key: <key>')")
    key = ring.lookup(secret.strip())
    if key is None:
        raise Unauthenticated("invalid API key")  # never echo what was sent
    return key


async def authenticate(request: Request) -> None:
    """Route dependency: 401 unless the request carries a valid key (when the gateway has keys)."""
    request.state.api_key = key_of(request.app.state.gateway, request.headers.get("authorization", ""),
                                   request.headers.get("x-api-key", ""))


def request_key(request: Request) -> ApiKey | None:
    return getattr(request.state, "api_key", None)


async def admit_key(state, key: ApiKey | None, model: str, scope_state: dict) -> None:
    """403 when `key` may not use `model` (whether or not it exists: no probing by 403/404), 429 when its quota is
    spent; names the model in the metrics labels (`scope_state`, the request's) once it is known."""
    scope_state["model"] = model if model in state.models or model in state.settings.aliases else ""
    if key is None:
        return
    CALLER.set(key.name)
    if not key.allows(model):
        raise Forbidden(f"this API key may not use model {model!r}", param="model")
    await state.quotas.admit(key)


async def admit(request: Request, model: str) -> None:
    await admit_key(request.app.state.gateway, request_key(request), model, request.scope.setdefault("state", {}))
