"""Wire models of /v1/chat/completions and /v1/completions: OpenAI's fields, with bounds.

Unknown fields are refused (422) rather than passed to vLLM; limits that depend on the deployment
(max_tokens, n, stop count) are checked in serving.py against the settings.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart]
    name: StrictStr | None = Field(None, max_length=64)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: StrictStr = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1)
    stop: StrictStr | list[StrictStr] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = None
    user: StrictStr | None = Field(None, max_length=256)

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[StrictStr]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool | None = None
