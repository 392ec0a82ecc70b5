"""What every text endpoint (classify, NER, embeddings) shares: the request shape whose `input` is one text or a
list of them, and the deployment's limits on texts per request and characters per text."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, StrictStr, field_validator

from ..exceptions import InvalidRequest
from ..settings import GatewaySettings


class TextInputRequest(BaseModel):
    """A request on `model` whose `input` is one string or a list of them (made a list here); no
    unknown fields, no empty list, no blank text. Subclasses declare `input`'s type."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr = Field(min_length=1, max_length=256)

    # Empty inputs are declared in the schema (Texts) and refused here first, in plain words.
    @field_validator("input", mode="before", check_fields=False)
    @classmethod
    def _one_or_many(cls, value):
        items = [value] if isinstance(value, (str, dict)) else value
        if isinstance(items, list):
            if not items:
                raise ValueError("must hold at least one text")
            for i, item in enumerate(items):
                if isinstance(item, str) and not item.strip():
                    raise ValueError(f"text {i} is empty")
        return items


def check_count(limits: GatewaySettings, items: list, what: str) -> None:
    """At most the deployment's `max_inputs` texts or images in one request."""
    if len(items) > limits.max_inputs:
        raise InvalidRequest(f"at most {limits.max_inputs} {what} per request, got {len(items)}", param="input")


def check_texts(limits: GatewaySettings, texts: list[str]) -> list[str]:
    """The deployment's limits on texts per request and characters per text."""
    check_count(limits, texts, "texts")
    for i, text in enumerate(texts):
        if len(text) > limits.max_input_chars:
            raise InvalidRequest(
                f"text {i} has {len(text)} characters; the limit is {limits.max_input_chars}", param="input"
            )
    return texts
