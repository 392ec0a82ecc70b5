"""Wire models of /v1/chat/completions, /v1/completions, /v1/responses (OpenAI's Responses API), /v1/messages
(Anthropic's Messages API), and vLLM's /tokenize and /detokenize.

The gateway is never stricter than vLLM on a valid request: only the fields that cost money or
memory are typed here (serving.py bounds them against the settings); every other field, OpenAI's
(tools, response_format, logit_bias, ...), vLLM's extras (top_k, min_p, ignore_eos, structured
outputs, ...) and fields that appear later, is relayed as sent, and vLLM's own 400 comes back to
the client in our error shape.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, StrictStr

from ..inputs.wire import SafeInt, TokenId


class _Generation(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: StrictStr = Field(min_length=1, max_length=256)
    max_tokens: SafeInt | None = None
    n: SafeInt | None = None
    best_of: SafeInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: bool | None = False
    stream_options: dict | None = None

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatCompletionRequest(_Generation):
    """OpenAI chat completions; messages and tools are relayed as sent, bounded in count and size."""

    messages: list[dict] = Field(min_length=1)
    max_completion_tokens: SafeInt | None = None
    logprobs: bool | None = None
    top_logprobs: SafeInt | None = None
    tools: list[dict] | None = None


class CompletionRequest(_Generation):
    """OpenAI text completions: a prompt as text, texts, token ids or lists of token ids."""

    prompt: StrictStr | list[StrictStr] | list[TokenId] | list[list[TokenId]]
    logprobs: SafeInt | None = None


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages (rendered with the model's chat template); bounded in size, the
    rest (add_special_tokens, add_generation_prompt, return_token_strs, ...) relayed as sent."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr = Field(min_length=1, max_length=256)
    prompt: StrictStr | None = None
    messages: list[dict] | None = None


class DetokenizeRequest(BaseModel):
    """vLLM's /detokenize: token ids back to text."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr = Field(min_length=1, max_length=256)
    tokens: list[TokenId]


class ResponsesRequest(BaseModel):
    """OpenAI's Responses API: `input` (a text, or items: messages with text and image parts, tool calls and their
    outputs), `instructions` and `tools` bounded in count and size, `max_output_tokens` in length; the rest
    (reasoning, text.format, tool_choice, ...) relayed as sent."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr = Field(min_length=1, max_length=256)
    input: StrictStr | list[dict]
    instructions: StrictStr | None = None
    max_output_tokens: SafeInt | None = None
    tools: list[dict] | None = None
    stream: bool | None = False


class CountTokensRequest(BaseModel):
    """Anthropic's `messages.count_tokens` (Claude Code asks before every turn): a Messages request's prompt, no
    length; bounded as its prompt is."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr = Field(min_length=1, max_length=256)
    messages: list[dict] = Field(min_length=1)
    system: StrictStr | list[dict] | None = None
    tools: list[dict] | None = None


class MessagesRequest(BaseModel):
    """Anthropic's Messages API: `messages` (text, image and tool blocks), `system` and `tools` bounded in count and
    size, `max_tokens` (required, as Anthropic's API requires it) in length; the rest relayed as sent."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr = Field(min_length=1, max_length=256)
    messages: list[dict] = Field(min_length=1)
    max_tokens: SafeInt
    system: StrictStr | list[dict] | None = None
    stop_sequences: list[StrictStr] | None = None
    tools: list[dict] | None = None
    stream: bool | None = False
