"""B1s's synthetic engine (bench/stream_cost.py) answers as vLLM does, and its report (the real run is part of
`rtxserve bench gateway`: nginx, the Python relay and the gateway in front of it)."""

import orjson
from fastapi.testclient import TestClient

from bench import stream_cost
from serve.gateway.backends.vllm import _one_token_event


def test_the_synthetic_engine_streams_vllm_s_events_and_answers_the_canary_whole(monkeypatch):
    monkeypatch.setenv(stream_cost.TOKENS_ENV, "3")
    monkeypatch.setenv(stream_cost.GAP_ENV, "0")
    with TestClient(stream_cost.engine) as client:
        models = client.get("/v1/models").json()["data"]
        streamed = client.post("/v1/completions", json={"model": stream_cost.SERVED, "prompt": "hi", "stream": True})
        whole = client.post("/v1/completions", json={"model": stream_cost.SERVED, "prompt": "ok", "max_tokens": 1})
    assert models[0]["id"] == stream_cost.SERVED and models[0]["max_model_len"] == 512  # as vLLM lists a model
    events = [event + b"\n\n" for event in streamed.content.split(b"\n\n") if event]
    assert [_one_token_event(event) for event in events] == [True, True, True, False, False]  # what vLLM's tokens are
    assert orjson.loads(events[3][6:])["usage"]["completion_tokens"] == 3 and events[4] == b"data: [DONE]\n\n"
    assert whole.json()["choices"][0]["text"] and whole.headers["content-type"] == "application/json"


def test_the_report_gives_each_front_end_s_cpu_a_token_and_what_the_gateway_adds():
    result = {"streams": 16, "tokens": 64, "gap_s": 0.004, "duration_s": 8.0, "rounds": 5, "failed": 0,
              "cpu_us_per_token": {"proxy": 12.5, "python relay": 25.0, "gateway": 30.0},
              "gateway_over_relay": 1.2, "gateway_added_us": 5.0,
              "calls_per_token": {"proxy": [1.0, 1.0], "python relay": [1.03, 1.05], "gateway": [1.03, 1.06]}}
    text = "\n".join(stream_cost.markdown(result))
    assert "64 token events 4 ms apart, 16 streams" in text and "| gateway | 30.0 | 1.03 / 1.06 |" in text
    assert "adds 5.0 us a token to the Python relay's (1.2x its CPU)" in text
