"""Make the backend clients the settings ask for."""

from __future__ import annotations

from ..settings import GatewaySettings
from .base import Backend

KINDS = ("triton", "vllm")


def make_backend(kind: str, settings: GatewaySettings) -> Backend:
    if kind == "triton":
        from .triton import TritonBackend

        return TritonBackend(settings.triton_grpc_url)
    if kind == "vllm":
        from .vllm import VLLMBackend

        return VLLMBackend(settings.vllm_url, settings.generation_timeout_s)
    raise ValueError(f"unknown backend kind {kind!r}; valid: {', '.join(KINDS)}")


def make_backends(settings: GatewaySettings) -> list[Backend]:
    """Triton when `triton_grpc_url` is set, vLLM when `vllm_url` is set (an empty value turns one off)."""
    urls = {"triton": settings.triton_grpc_url, "vllm": settings.vllm_url}
    return [make_backend(kind, settings) for kind in KINDS if urls[kind]]
