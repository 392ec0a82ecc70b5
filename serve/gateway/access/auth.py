"""Who may call what: the API key of a request (a route dependency) and the models it may use.

With no keys file the gateway runs open (the settings allow that on loopback only); with one, every
model route needs `Authorization: Bearer <key>` (what the `openai` SDK sends as its `api_key`) or `x-api-key: <key>`
(what the `anthropic` SDK sends).
Health, readiness and metrics stay open for probes and Prometheus.
"""

from __future__ import annotations

from fastapi import Request

from .keys import ApiKey


async def authenticate(request: Request) -> None:
    """Route dependency: 401 unless the request carries a valid key (when the gateway has keys)."""
    request.state.api_key = request.app.state.gateway.access.key_of(
        request.headers.get("authorization", ""), request.headers.get("x-api-key", ""), request.scope.get("state"))


def request_key(request: Request) -> ApiKey | None:
    return getattr(request.state, "api_key", None)


async def admit_key(state, key: ApiKey | None, model: str, scope_state: dict) -> None:
    """`key`'s admission to `model` (access.Access.admit), naming the model in the metrics labels (`scope_state`, the
    request's) once it is known."""
    scope_state["model"] = model if model in state.registry.models or state.rollout.serves(model) else ""
    await state.access.admit(key, model)


async def admit(request: Request, model: str) -> None:
    await admit_key(request.app.state.gateway, request_key(request), model, request.scope.setdefault("state", {}))
