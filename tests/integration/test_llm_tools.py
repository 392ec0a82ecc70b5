"""What agents and structured-output clients send, through the real gateway to the real vLLM, with the
`openai` SDK: tool calls, JSON schemas, vLLM's sampling extras. None of it is refused by the gateway."""

import json

import jsonschema
import openai
import pytest

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Paris"]}},
                   "required": ["city"]}}}
# A pattern on the string: xgrammar lets a free string carry raw control characters, which the random
# model does emit and which no JSON parser takes.
ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "pattern": "^[a-z ]{1,12}$"},
                                           "score": {"type": "integer"}},
          "required": ["answer", "score"], "additionalProperties": False}


@pytest.fixture
def sdk(llm_gateway):
    return openai.OpenAI(base_url=f"{llm_gateway}/v1", api_key="unused", max_retries=0, timeout=60)


def test_tool_choice_required_returns_a_parseable_tool_call(sdk):
    # A seed rather than greedy decoding: greedy on random weights repeats one token until max_tokens.
    r = sdk.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "weather in Oslo?"}],
                                    tools=[WEATHER], tool_choice="required", max_tokens=128, seed=0, temperature=1)
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    json.loads(call.function.arguments)


def test_a_tool_conversation_round_trip_is_accepted(sdk):
    messages = [{"role": "user", "content": "weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = sdk.chat.completions.create(model="adapter-a", messages=messages, tools=[WEATHER], tool_choice="auto",
                                    parallel_tool_calls=False, max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in {"length", "stop", "tool_calls"}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_response_format_json_schema_returns_valid_json(sdk, seed):
    r = sdk.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "rate this"}], max_tokens=96, seed=seed,
        response_format={"type": "json_schema", "json_schema": {"name": "rating", "schema": ANSWER, "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), ANSWER)


def test_json_mode_and_vllm_extras_pass_through(sdk):
    r = sdk.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=6, logit_bias={"15": -100},
        store=False, metadata={"team": "search"}, seed=3, response_format={"type": "json_object"},
        extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True})
    assert r.usage.completion_tokens == 6  # ignore_eos reached vLLM: it ran to max_tokens


def test_continuous_usage_stats_reach_every_chunk(sdk):
    chunks = list(sdk.chat.completions.create(
        model="adapter-b", messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    with_text = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert with_text and all(c.usage is not None for c in with_text)
    assert chunks[-1].usage.completion_tokens == 5


def test_vllms_own_400_comes_back_in_our_shape(sdk):
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                    tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    assert "does not match any of the specified `tools`" in info.value.message
    assert info.value.body["type"] == "invalid_request_error" and info.value.body["param"] == "tool_choice"
