"""The key and quota context of the gateway: its API keys (keys.py) and their per-minute quotas (quotas.py), and the
key name of the request being served.

With no keys file the gateway runs open (the settings allow that on loopback only), and nothing is counted.
"""

from __future__ import annotations

from contextvars import ContextVar

from ..exceptions import Forbidden, Unauthenticated
from ..settings import GatewaySettings
from .keys import ApiKey, KeyRing
from .quotas import Quotas

# The API key name of the request being served (set where its key is admitted): what a sticky alias keeps on one model.
CALLER: ContextVar[str | None] = ContextVar("rtxserve_caller", default=None)
CALLER_PRIORITY: ContextVar[int] = ContextVar("rtxserve_caller_priority", default=0)  # its key's, for the model gates
# Its key's scope (the models it may use): the answer cache (fleet/answer_cache.py) never shares an answer across scopes.
CALLER_SCOPE: ContextVar[tuple[str, ...] | None] = ContextVar("rtxserve_caller_scope", default=None)
# The key an in-process request runs as, in its ASGI scope's state: set by the batch runner (batches/runner.py) for
# each line it sends through the gateway's front door; never from anything a client sends.
RUN_AS = "rtxserve.run_as"


class Access:
    def __init__(self, settings: GatewaySettings):
        self.keys = KeyRing(settings.keys_file) if settings.keys_file else None
        self.quotas = (Quotas(settings.rate_limit_storage or "async+memory://", settings.rate_limit_unavailable)
                       if self.keys else None)

    def key_of(self, authorization: str, api_key: str = "", scope_state: dict | None = None) -> ApiKey | None:
        """The key an `Authorization: Bearer` header names, else an `x-api-key` header: None when the gateway has no
        keys; 401 when it has and the headers do not name one of them. A batch line's request (`scope_state` holds
        RUN_AS) runs as its batch's key."""
        if scope_state and RUN_AS in scope_state:
            return scope_state[RUN_AS]
        if self.keys is None:
            return None
        scheme, _, secret = authorization.partition(" ")
        if not authorization and api_key.strip():
            scheme, secret = "bearer", api_key
        if scheme.lower() != "bearer" or not secret.strip():
            raise Unauthenticated("missing API key: send the header 'Authorization: Bearer <key>' (or 'x-api-key: <key>')")
        key = self.keys.lookup(secret.strip())
        if key is None:
            raise Unauthenticated("invalid API key")  # never echo what was sent
        return key

    async def admit(self, key: ApiKey | None, model: str) -> None:
        """403 when `key` may not use `model` (whether or not it exists: no probing by 403/404), 429 when its quota
        is spent."""
        if key is None:
            return
        CALLER.set(key.name)
        CALLER_PRIORITY.set(key.priority)
        CALLER_SCOPE.set(key.scope)
        if not key.allows(model):
            raise Forbidden(f"this API key may not use model {model!r}", param="model")
        if self.quotas is not None:  # None: a gateway without keys, running a batch
            await self.quotas.admit(key)

    async def charge_tokens(self, key: ApiKey | None, tokens: int) -> None:
        if self.quotas is not None:
            await self.quotas.charge_tokens(key, tokens)
