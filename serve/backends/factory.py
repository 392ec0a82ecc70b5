"""Make a backend client by kind."""

from __future__ import annotations

from ..settings import GatewaySettings
from .base import Backend

KINDS = ("triton",)


def make_backend(kind: str, settings: GatewaySettings) -> Backend:
    if kind == "triton":
        from .triton import TritonBackend

        return TritonBackend(settings.triton_grpc_url)
    raise ValueError(f"unknown backend kind {kind!r}; valid: {', '.join(KINDS)}")
