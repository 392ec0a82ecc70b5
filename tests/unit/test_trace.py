"""The traffic trace in process, on fake backends: one line per model request with its sizes, times, status and
prefix-block hashes, never its text; nothing written when it is off."""

import json
import time

from fastapi.testclient import TestClient

from serve.gateway.app import create_app
from serve.gateway.settings import GatewaySettings

from .fakes import FakeTriton
from .test_generate import FakeStream, FakeVLLM, _chunk

SYSTEM = "You answer questions about the orders of a small shop, briefly and politely. " * 3  # 231 characters
SECRET = "zanzibar"


def trace_lines(folder, count: int, timeout_s: float = 10) -> list[dict]:
    """The trace's lines once `count` are written (every trace.FLUSH_S)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        # whole lines only: the last may be half written as it is read
        lines = [json.loads(x) for f in sorted(folder.glob("trace-*.jsonl")) for x in f.read_text().split("\n")[:-1]]
        if len(lines) >= count:
            return lines
        time.sleep(0.02)
    raise AssertionError(f"{len(lines)} trace lines after {timeout_s} s, expected {count}")


def chat(question: str, **extra) -> dict:
    return {"model": "llm", "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            "max_tokens": 5, **extra}


def test_each_model_request_is_one_line_of_sizes_and_times_never_text(tmp_path):
    vllm = FakeVLLM()
    settings = GatewaySettings(trace_dir=tmp_path / "trace", health_interval_s=60)
    with TestClient(create_app(settings, [FakeTriton(), vllm])) as client:
        assert client.post("/v1/classify", json={"model": "clf", "input": [f"good {SECRET}", "bad"]}).status_code == 200
        assert client.post("/v1/classify", json={"model": "clf", "input": "good"}).status_code == 200  # one text
        assert client.post("/v1/classify", json={"model": "clf", "input": [f"good {SECRET}", "bad"]}).status_code == 200
        assert client.post("/v1/chat/completions", json=chat(f"where is my order {SECRET}?")).status_code == 200
        vllm.stream = FakeStream([_chunk("a"), _chunk(usage={"prompt_tokens": 7, "completion_tokens": 1,
                                                             "total_tokens": 8}), "data: [DONE]"])
        assert client.post("/v1/chat/completions", json=chat(f"and my refund {SECRET}?", stream=True)).status_code == 200
        assert client.post("/v1/chat/completions", json={"model": "nope", "messages": []}).status_code == 422
        client.get("/v1/models")  # not a model request: not traced
        lines = trace_lines(tmp_path / "trace", 6)
    classify, one, again, whole, streamed, refused = lines
    assert SECRET not in "".join(f.read_text() for f in (tmp_path / "trace").iterdir())
    assert {k: classify[k] for k in ("route", "model", "status", "items", "chars", "images")} == {
        "route": "/v1/classify", "model": "clf", "status": 200, "items": 2, "chars": 16, "images": 0}
    assert (one["items"], one["chars"]) == (1, 4)
    assert again["input_hash"] == classify["input_hash"] != one["input_hash"]  # a repeated input, and another
    assert {k: whole[k] for k in ("route", "model", "status", "input_tokens", "output_tokens")} == {
        "route": "/v1/chat/completions", "model": "llm", "status": 200, "input_tokens": 3, "output_tokens": 5}
    assert "ttft_ms" not in whole and 0 < streamed["ttft_ms"] <= streamed["latency_ms"]
    assert (streamed["input_tokens"], streamed["output_tokens"]) == (7, 1)
    # the shared system prompt: the same leading blocks (64 characters each), then the questions part
    shared = len(SYSTEM) // 64
    assert whole["hash_ids"][:shared] == streamed["hash_ids"][:shared] and len(whole["hash_ids"]) >= shared
    assert refused["status"] == 422 and "hash_ids" not in refused
    assert all(a["t"] <= b["t"] for a, b in zip(lines, lines[1:]))


def test_off_by_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with TestClient(create_app(GatewaySettings(health_interval_s=60), [FakeTriton()])) as client:
        assert client.post("/v1/classify", json={"model": "clf", "input": "good"}).status_code == 200
    assert list(tmp_path.rglob("trace-*")) == []
