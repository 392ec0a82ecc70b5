"""The official `openai` SDK through the real gateway to the real vLLM server: a base model and two
LoRA adapters, chat and completions, streamed and not."""

import openai
import pytest

from serve.stack import start_gateway

from .conftest import LLM_MODELS as MODELS


@pytest.fixture
def sdk(llm_gateway):
    return openai.OpenAI(base_url=f"{llm_gateway}/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_lists_the_base_and_its_adapters(sdk):
    assert sorted(m.id for m in sdk.models.list()) == sorted(MODELS)


@pytest.mark.parametrize("model", MODELS)
def test_chat_non_streamed_and_streamed_agree(sdk, model):
    messages = [{"role": "user", "content": "hello, how can i help you today?"}]
    whole = sdk.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    assert whole.model == model and whole.usage.completion_tokens == 8 and whole.usage.prompt_tokens > 0
    chunks = list(sdk.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 8


def test_adapters_change_the_output(sdk):
    outputs = {m: sdk.completions.create(model=m, prompt="the model answers", max_tokens=12, temperature=0).choices[0].text
               for m in MODELS}
    assert len(set(outputs.values())) == 3, outputs


def test_completions_stream(sdk):
    chunks = list(sdk.completions.create(model="adapter-b", prompt="hello", max_tokens=6, temperature=0, stream=True))
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) >= 1


def test_prompt_longer_than_the_context_is_400_saying_by_how_much(sdk):
    with pytest.raises(openai.BadRequestError) as info:
        sdk.completions.create(model="tiny-llama", prompt="hello " * 400, max_tokens=4)
    assert "maximum context length is 512" in info.value.message


def test_abusive_parameters_are_refused_before_vllm(sdk):
    with pytest.raises(openai.BadRequestError):
        sdk.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "x"}], n=50)
    with pytest.raises(openai.BadRequestError, match="at most 4096"):
        sdk.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "x"}], max_tokens=10**6)


def test_a_chat_that_names_no_length_stops_at_the_gateways_max_tokens(llm_servers, tmp_path):
    """vLLM, asked with no max_tokens, generates to the end of the context (ignore_eos keeps it going); through a
    gateway whose max_tokens is 16, the same request stops at 16, streamed or not, and usage counts them."""
    _, vllm_url, _ = llm_servers
    gateway, url = start_gateway("", tmp_path, vllm_url=vllm_url, extra_env={"RTXSERVE_MAX_TOKENS": "16"})
    try:
        messages = [{"role": "user", "content": "hello"}]
        extra = {"ignore_eos": True}
        direct = openai.OpenAI(base_url=f"{vllm_url}/v1", api_key="unused", max_retries=0, timeout=120)
        assert direct.chat.completions.create(model="tiny-llama", messages=messages, extra_body=extra
                                              ).usage.completion_tokens > 16
        sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        assert sdk.chat.completions.create(model="tiny-llama", messages=messages, extra_body=extra
                                           ).usage.completion_tokens == 16
        chunks = list(sdk.chat.completions.create(model="adapter-a", messages=messages, extra_body=extra, stream=True,
                                                  stream_options={"include_usage": True}))
        assert chunks[-1].usage.completion_tokens == 16
    finally:
        gateway.stop()


@pytest.mark.parametrize("model", MODELS)
def test_tokenize_and_detokenize_through_the_gateway_answer_as_vllm_does(llm_servers, model):
    """vLLM's /tokenize (a prompt, or a chat through the model's template) and /detokenize, relayed for a base model
    and its adapters; vLLM's own 400 comes back in the gateway's error shape."""
    import httpx

    url, vllm_url, _ = llm_servers
    for body in ({"model": model, "prompt": "hello, how can i help you today?"},
                 {"model": model, "messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True}):
        ours = httpx.post(f"{url}/tokenize", json=body, timeout=30)
        assert ours.status_code == 200 and ours.json() == httpx.post(f"{vllm_url}/tokenize", json=body, timeout=30).json()
        assert ours.json()["count"] == len(ours.json()["tokens"]) > 0
    tokens = {"model": model, "tokens": ours.json()["tokens"]}
    back = httpx.post(f"{url}/detokenize", json=tokens, timeout=30)
    assert back.status_code == 200 and back.json() == httpx.post(f"{vllm_url}/detokenize", json=tokens, timeout=30).json()
    assert "hi" in back.json()["prompt"]
    neither = httpx.post(f"{url}/tokenize", json={"model": model}, timeout=30)  # no prompt, no messages: vLLM's to say
    assert neither.status_code == 400 and set(neither.json()["error"]) == {"message", "type", "param", "code"}
