"""OpenAI generation endpoints in-process with a fake vLLM backend: bounds, routing, stream relay."""

import json

import pytest
from fastapi.testclient import TestClient

from serve.backends.base import Backend, ModelInfo
from serve.gateway.app import create_app
from serve.settings import GatewaySettings


class FakeStream:
    def __init__(self, lines):
        self.lines, self.closed = lines, False

    async def aiter_lines(self):
        for line in self.lines:
            yield line

    async def aclose(self):
        self.closed = True


class FakeVLLM(Backend):
    kind = "vllm"

    def __init__(self):
        self.bodies, self.stream = [], None

    async def discover(self):
        return [ModelInfo("llm", "text-generation", "vllm", True), ModelInfo("llm-lora", "text-generation", "vllm", True)]

    async def generate(self, path, body, model):
        self.bodies.append(body)
        return {"object": "chat.completion", "model": model, "choices": [],
                "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}}

    async def open_stream(self, path, body, model):
        self.bodies.append(body)
        return self.stream


def _chunk(text="", usage=None):
    choices = [] if usage else [{"index": 0, "delta": {"content": text}}]
    return "data: " + json.dumps({"object": "chat.completion.chunk", "choices": choices, "usage": usage})


@pytest.fixture
def backend():
    return FakeVLLM()


@pytest.fixture
def client(backend):
    with TestClient(create_app(GatewaySettings(max_tokens=100, max_n=2, health_interval_s=60), [backend])) as c:
        yield c


CHAT = {"model": "llm-lora", "messages": [{"role": "user", "content": "hi"}]}


def test_chat_routes_to_the_adapter_and_counts_usage(client, backend):
    r = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 10})
    assert r.status_code == 200 and backend.bodies[-1]["model"] == "llm-lora"
    metrics = client.get("/metrics").text
    assert 'rtxserve_tokens_total{kind="completion",model="llm-lora"} 5.0' in metrics


@pytest.mark.parametrize(
    "extra, status, param",
    [
        ({"max_tokens": 101}, 400, "max_tokens"),
        ({"n": 3}, 400, "n"),
        ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({"top_logprobs": 21}, 422, "top_logprobs"),
        ({"temperature": 3}, 422, "temperature"),
        ({"max_tokens": 0}, 422, "max_tokens"),
        ({"frobnicate": True}, 422, "frobnicate"),
        ({"messages": []}, 422, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, 422, "messages.0.role"),
    ],
)
def test_abusive_or_malformed_parameters_never_reach_vllm(client, backend, extra, status, param):
    r = client.post("/v1/chat/completions", json={**CHAT, **extra})
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
    assert backend.bodies == []


def test_completions_logprobs_bound(client, backend):
    r = client.post("/v1/completions", json={"model": "llm", "prompt": "x", "logprobs": 6})
    assert r.status_code == 422 and backend.bodies == []


def test_stream_is_relayed_and_usage_chunk_only_sent_when_asked(client, backend):
    backend.stream = FakeStream([_chunk("Hel"), _chunk("lo"), _chunk(usage={"prompt_tokens": 2, "completion_tokens": 2}), "data: [DONE]"])
    r = client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    events = [e for e in r.text.split("\n\n") if e]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert len(events) == 3 and events[-1] == "data: [DONE]"  # usage chunk dropped: not asked for
    assert backend.bodies[-1]["stream_options"] == {"include_usage": True}  # but always asked of vLLM
    assert backend.stream.closed


def test_a_stream_cut_short_ends_with_an_error_event_not_done(client, backend):
    backend.stream = FakeStream([_chunk("Hel")])  # no [DONE]: the backend died
    r = client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    events = [e for e in r.text.split("\n\n") if e]
    assert "[DONE]" not in r.text
    error = json.loads(events[-1].removeprefix("data: "))["error"]
    assert error["code"] == "backend_stream_error" and "partial" in error["message"]


def test_classify_models_are_not_generation_models(client):
    r = client.post("/v1/chat/completions", json={**CHAT, "model": "unknown"})
    assert r.status_code == 404
