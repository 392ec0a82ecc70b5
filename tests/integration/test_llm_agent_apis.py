"""OpenAI's Responses API (the `openai` SDK's `responses.create`) and Anthropic's Messages API (the `anthropic` SDK's
`messages.create` / `messages.stream`) through the real gateway to the real vLLM, streamed and not, with tools: each
answer equal to the same call straight to vLLM, usage counted, lengths bounded."""

import anthropic
import httpx
import openai
import pytest

from tests.integration import routes_not_through_the_gateway

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
OPENAI_TOOLS = [{"type": "function", "name": "get_weather", "description": "the weather in a city", "parameters": WEATHER}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "the weather in a city", "input_schema": WEATHER}]
PROMPT = "hello, how can i help you today?"


@pytest.fixture
def both(llm_servers):
    """(gateway, vLLM): the `openai` and `anthropic` SDKs on each."""
    gateway, vllm, _ = llm_servers
    return {name: (openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60),
                   anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=60))
            for name, url in (("gateway", gateway), ("vllm", vllm))}


def _tokens(gateway: str) -> dict[str, float]:
    text = httpx.get(f"{gateway}/metrics", timeout=10).text
    return {kind: sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      if line.startswith("rtxserve_tokens_total{") and f'kind="{kind}"' in line)
            for kind in ("prompt", "completion")}


@pytest.mark.parametrize("tools", [None, OPENAI_TOOLS])
def test_responses_streamed_and_not_are_vllms(both, llm_gateway, tools):
    call = dict(model="tiny-llama", input=PROMPT, max_output_tokens=8, temperature=0, **({"tools": tools} if tools else {}))
    before = _tokens(llm_gateway)
    ours, theirs = (both[name][0].responses.create(**call) for name in ("gateway", "vllm"))
    assert ours.output_text and ours.output_text == theirs.output_text
    assert ours.usage.output_tokens == theirs.usage.output_tokens == 8
    events = list(both["gateway"][0].responses.create(**call, stream=True))
    assert [e.type for e in events][:2] == ["response.created", "response.in_progress"]
    assert events[-1].type == "response.completed" and events[-1].response.usage.output_tokens == 8
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == ours.output_text
    after = _tokens(llm_gateway)
    assert after["completion"] - before["completion"] == 16  # both answers counted, the streamed one from its last event
    assert after["prompt"] - before["prompt"] == 2 * ours.usage.input_tokens


@pytest.mark.parametrize("tools", [None, ANTHROPIC_TOOLS])
def test_messages_streamed_and_not_are_vllms(both, llm_gateway, tools):
    # anthropic 2.x has no temperature argument (Anthropic's newest models take none); vLLM reads it from the body
    call = dict(model="tiny-llama", max_tokens=8, extra_body={"temperature": 0}, messages=[{"role": "user", "content": PROMPT}],
                system="You answer questions about orders.", **({"tools": tools} if tools else {}))
    before = _tokens(llm_gateway)
    ours, theirs = (both[name][1].messages.create(**call) for name in ("gateway", "vllm"))
    assert ours.content[0].text and [b.text for b in ours.content] == [b.text for b in theirs.content]
    assert ours.usage.output_tokens == theirs.usage.output_tokens == 8 and ours.stop_reason == "max_tokens"
    with both["gateway"][1].messages.stream(**call) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == ours.content[0].text and final.usage.output_tokens == 8
    after = _tokens(llm_gateway)
    assert after["completion"] - before["completion"] == 16
    assert after["prompt"] - before["prompt"] == 2 * ours.usage.input_tokens


def test_an_adapter_answers_both_apis(both):
    """Adapters are models like the base, for these APIs as for chat."""
    greedy = {"extra_body": {"temperature": 0}, "messages": [{"role": "user", "content": "the model answers"}]}
    base = both["gateway"][1].messages.create(model="tiny-llama", max_tokens=12, **greedy)
    adapter = both["gateway"][1].messages.create(model="adapter-a", max_tokens=12, **greedy)
    assert base.content[0].text != adapter.content[0].text
    # Greedy and to the length asked: a sampled 3 tokens from a random-weight model may decode to nothing at all
    call = dict(model="adapter-b", input="hello", max_output_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    ours, theirs = (both[name][0].responses.create(**call) for name in ("gateway", "vllm"))
    assert ours.model == "adapter-b" and ours.usage.output_tokens == 3
    assert ours.output_text and ours.output_text == theirs.output_text


def test_lengths_are_bounded_and_an_omitted_one_is_sent(both):
    with pytest.raises(anthropic.BadRequestError, match="at most 4096"):
        both["gateway"][1].messages.create(model="tiny-llama", max_tokens=10**6,
                                           messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="at most 4096"):
        both["gateway"][0].responses.create(model="tiny-llama", input="x", max_output_tokens=10**6)
    # No max_output_tokens: vLLM alone refuses none and runs to the end of the context; the gateway sends its bound
    # (the model's 512-token context, being the smaller), so the answer stops where the context does, not before.
    answer = both["gateway"][0].responses.create(model="tiny-llama", input="x", temperature=0,
                                                 extra_body={"ignore_eos": True})
    assert answer.usage.input_tokens + answer.usage.output_tokens <= 512 and answer.usage.output_tokens > 16
    with pytest.raises(anthropic.BadRequestError, match="images"):
        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}}
        both["gateway"][1].messages.create(model="tiny-llama", max_tokens=4,
                                           messages=[{"role": "user", "content": [image] * 9}])


@pytest.mark.parametrize("tools", [None, ANTHROPIC_TOOLS])
def test_messages_count_tokens_is_vllms_and_bounded(both, llm_gateway, tools):
    """The `anthropic` SDK's messages.count_tokens (Claude Code calls it before every turn): vLLM's count, through the
    gateway; a prompt over the gateway's bound is refused before vLLM sees it."""
    call = dict(model="tiny-llama", messages=[{"role": "user", "content": PROMPT}], system="You answer questions.",
                **({"tools": tools} if tools else {}))
    ours, theirs = (both[name][1].messages.count_tokens(**call) for name in ("gateway", "vllm"))
    assert ours.input_tokens == theirs.input_tokens > 0
    before = _tokens(llm_gateway)
    with pytest.raises(anthropic.BadRequestError, match="this gateway allows at most 256"):
        both["gateway"][1].messages.count_tokens(model="tiny-llama",
                                                 messages=[{"role": "user", "content": "hi"}] * 257)
    assert _tokens(llm_gateway) == before  # counting generates nothing: no usage


def test_every_route_a_chat_engine_serves_is_relayed_or_refused_with_its_reason(llm_servers):
    gateway, vllm, _ = llm_servers
    assert routes_not_through_the_gateway(gateway, vllm) == []
