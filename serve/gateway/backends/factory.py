"""Make the backend clients the settings ask for."""

from __future__ import annotations

from ..settings import GatewaySettings
from .base import Backend

KINDS = ("triton", "vllm")


def make_backend(kind: str, url: str, settings: GatewaySettings) -> Backend:
    if kind == "triton":
        from .triton import TritonBackend

        return TritonBackend(url, settings.coalesce_calls)
    if kind == "vllm":
        from .vllm import VLLMBackend

        control = settings.engine_control.get(url, "")
        serves = tuple(n for name, m in settings.on_demand.items() if m.engine == url for n in (name, *m.adapters))
        return VLLMBackend(url, settings.generation_timeout_s, control, serves, settings.sleep_level)
    raise ValueError(f"unknown backend kind {kind!r}; valid: {', '.join(KINDS)}")


def make_backends(settings: GatewaySettings) -> list[Backend]:
    """One client per replica: each address in `triton_grpc_url` and `vllm_url` (an empty value turns a kind off)."""
    return [make_backend(kind, url, settings) for kind in KINDS for url in settings.urls(kind)]
