"""vLLM's runtime LoRA API on the engines of one base model: an adapter loaded on every one of them or on none (when
one refuses, those that loaded it unload it again), and unloaded from every one. `rtxserve adapters add|remove`
(deploy/adapters.py, on the box) and the gateway's admin route (`/admin/adapters`, with an admin key) both call it.

The engines must run with VLLM_ALLOW_RUNTIME_LORA_UPDATING (serve.vllm_server.runtime_lora_env: every engine with LoRA on).
vLLM loads an adapter beside the running batch: streams in flight are not touched.
"""

from __future__ import annotations

import httpx

LOAD_TIMEOUT_S = 120.0  # vLLM reads the adapter's weights before it answers


class RuntimeLoraError(Exception):
    """An adapter not loaded (nothing left half-loaded) or not unloaded everywhere; one line, naming the engine."""


def _post(url: str, path: str, body: dict) -> str | None:
    """None when vLLM did it; else why not, in one line."""
    try:
        r = httpx.post(f"{url}{path}", json=body, timeout=LOAD_TIMEOUT_S)
    except httpx.HTTPError as exc:
        return f"{url} did not answer ({type(exc).__name__})"
    if r.status_code == 200:
        return None
    try:
        message = r.json().get("error", {}).get("message") or r.text
    except (ValueError, AttributeError):
        message = r.text
    if r.status_code == 404 and r.text.strip() == '{"detail":"Not Found"}':  # the route itself is missing
        message = "its runtime LoRA API is off (start it again with `serve up`, which turns it on)"
    return f"{url} answered {r.status_code}: {' '.join(str(message).split())[:300]}"


def load_everywhere(urls: list[str], name: str, path: str) -> None:
    """Load the adapter at `path` (as the engines see it) as `name` on every engine in `urls`, or on none."""
    loaded = []
    for url in urls:
        why = _post(url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        if why is not None:
            for done in loaded:  # nothing stays half-loaded
                _post(done, "/v1/unload_lora_adapter", {"lora_name": name})
            raise RuntimeLoraError(f"adapter {name} not loaded: {why}")
        loaded.append(url)


def unload_everywhere(urls: list[str], name: str) -> None:
    failed = [why for url in urls if (why := _post(url, "/v1/unload_lora_adapter", {"lora_name": name})) is not None]
    if failed:
        raise RuntimeLoraError(f"adapter {name} not unloaded everywhere: {'; '.join(failed)}")
