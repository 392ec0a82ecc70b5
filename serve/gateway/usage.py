"""Token accounting every relayed vLLM API shares: the usage an answer reports, counted in the metrics and charged
to the key's tokens-per-minute quota."""

from __future__ import annotations

from . import metrics
from .access.keys import ApiKey
from .edge.recording import note
from .state import GatewayState


async def count_usage(state: GatewayState, key: ApiKey | None, model: str, usage: dict | None) -> None:
    """Token metrics, and the key's tokens-per-minute charge."""
    if usage:  # OpenAI's chat and completions name them prompt / completion, Responses and Anthropic input / output
        prompt = usage.get("prompt_tokens") or usage.get("input_tokens") or 0
        completion = usage.get("completion_tokens") or usage.get("output_tokens") or 0
        note(model=model, input_tokens=prompt, output_tokens=completion)
        metrics.TOKENS.labels(model, "prompt").inc(prompt)
        metrics.TOKENS.labels(model, "completion").inc(completion)
        await state.access.charge_tokens(key, prompt + completion)
