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
        asked = client.post("/v1/completions", json={"model": stream_cost.SERVED, "prompt": "hi", "stream": True,
                                                     "max_tokens": 5})
        whole = client.post("/v1/completions", json={"model": stream_cost.SERVED, "prompt": "ok", "max_tokens": 1})
    assert models[0]["id"] == stream_cost.SERVED and models[0]["max_model_len"] == 512  # as vLLM lists a model
    events = [event + b"\n\n" for event in streamed.content.split(b"\n\n") if event]
    assert [_one_token_event(event) for event in events] == [True, True, True, False, False]  # what vLLM's tokens are
    assert orjson.loads(events[3][6:])["usage"]["completion_tokens"] == 3 and events[4] == b"data: [DONE]\n\n"
    assert whole.json()["choices"][0]["text"] and whole.headers["content-type"] == "application/json"
    assert asked.content.count(b'"choices":[{') == 5  # a stream as long as asked: the fit's two lengths


def test_the_split_recovers_a_cost_per_request_and_per_token_from_runs_of_two_lengths():
    # runs made from 300 us a request and 20 us a token, at 8 and 64 tokens a stream, with unequal request counts
    runs = [(300 * n + 20 * n * length, n, n * length) for n, length in ((180, 64), (900, 8), (175, 64), (950, 8))]
    assert stream_cost.split(runs) == (300.0, 20.0)


def test_the_report_gives_each_front_end_s_cpu_a_token_and_what_the_gateway_adds():
    result = {"streams": 16, "tokens": 64, "gap_s": 0.004, "duration_s": 8.0, "rounds": 5, "failed": 0,
              "cpu_us_per_token": {"proxy": 12.5, "python relay": 25.0, "gateway": 30.0},
              "gateway_over_relay": 1.2, "gateway_added_us": 5.0,
              "calls_per_token": {"proxy": [1.0, 1.0], "python relay": [1.03, 1.05], "gateway": [1.03, 1.06]}}
    text = "\n".join(stream_cost.markdown(result))
    assert "64 token events 4 ms apart, 16 streams" in text and "| gateway | 30.0 | 1.03 / 1.06 |" in text
    assert "adds 5.0 us a token to the Python relay's (1.2x its CPU)" in text
    assert "fit" not in text and "py-spy" not in text  # a result from before the split: its page as it was


def test_the_report_splits_the_gateway_s_excess_and_sets_the_two_profiles_side_by_side():
    def profile(tokens, cpu_us, parts):
        return {"tokens": tokens, "samples": 400, "cpu_us_per_request": cpu_us, "parts": parts,
                "top": [("f (serve/gateway/x.py:1)", 9.5)]}

    result = {"streams": 16, "tokens": 64, "short": 8, "gap_s": 0.004, "duration_s": 8.0, "rounds": 5, "failed": 0,
              "cpu_us_per_token": {"proxy": 12.5, "python relay": 25.0, "gateway": 40.0},
              "gateway_over_relay": 1.6, "gateway_added_us": 15.0, "calls_per_token": {"gateway": [1.03, 1.06]},
              "split": {"proxy": {"per_request_us": 60.0, "per_token_us": 11.6},
                        "python relay": {"per_request_us": 320.0, "per_token_us": 20.0},
                        "gateway": {"per_request_us": 960.0, "per_token_us": 25.0}},
              "profile": {"python relay": [profile(8, 500.0, {"HTTP server": 60.0, "other": 40.0}),
                                           profile(64, 1620.0, {"HTTP server": 60.0, "other": 40.0})],
                          "gateway": [profile(8, 1000.0, {"HTTP server": 30.0, "validation and JSON": 50.0, "other": 20.0}),
                                      profile(64, 2176.0, {"HTTP server": 45.0, "validation and JSON": 25.0,
                                                           "other": 30.0})]}}
    text = "\n".join(stream_cost.markdown(result))
    assert "| gateway | 40.0 | 1.03 / 1.06 | 960.0 | 25.0 |" in text
    # 640 us a request more: 10.0 a token over 64; 5.0 more on each token
    assert "spends 640 us a request more than the relay, 10.0 us a token over a stream of 64, and 5.0 us more" in text
    # each part's CPU-us a request at 8 and 64 tokens, and the line through them: the relay's HTTP server 300 and 972
    # (12 a token, 204 a request), the gateway's 300 and 979.2 (12.13, 202.97); its validation 500 and 544 (0.79, 493.71)
    rows = [line for line in text.splitlines() if line.startswith(("| validation", "| HTTP server", "| other", "| all"))]
    assert rows == ["| validation and JSON | 0 | 494 | +494 | 0.00 | 0.79 | +0.79 |",
                    "| HTTP server | 204 | 203 | -1 | 12.00 | 12.13 | +0.13 |",
                    "| other | 136 | 135 | -1 | 8.00 | 8.09 | +0.09 |",
                    "| all | 340 | 832 | +492 | 20.00 | 21.00 | +1.00 |"]  # the largest excess (over 64 tokens) first
    assert "| `f (serve/gateway/x.py:1)` | 9.5 % |" in text
    assert "not profiled" in "\n".join(stream_cost.markdown({**result, "profile": {"error": "py-spy is not installed"}}))
