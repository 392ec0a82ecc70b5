"""A client that goes away mid-stream must not leave vLLM generating for nobody (the gateway closes the
upstream stream, and vLLM aborts the request)."""

import re
import time

import httpx


def _metric(vllm_url: str, name: str, labels: str = "") -> float:
    text = httpx.get(f"{vllm_url}/metrics", timeout=5).text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}{{[^}}]*{labels}[^}}]*}} (\S+)$", text, re.M))


def _completed(vllm_url: str) -> float:
    """Requests vLLM finished on its own (max_tokens reached or a stop), not aborted."""
    return sum(_metric(vllm_url, "vllm:request_success_total", f'finished_reason="{r}"') for r in ("length", "stop"))


def _settled(read, interval_s: float = 1.5, limit_s: float = 20.0) -> float:
    """`read()` once two reads `interval_s` apart agree (or at `limit_s`)."""
    value, deadline = read(), time.monotonic() + limit_s
    while time.monotonic() < deadline:
        time.sleep(interval_s)
        value, previous = read(), value
        if value == previous:
            break
    return value


def test_client_disconnect_aborts_the_generation_in_vllm(llm_servers):
    gateway, vllm_url, _ = llm_servers
    body = {"model": "adapter-b", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 230, "temperature": 0}
    # Greedy, so the streamed run is this one: it runs to max_tokens unless something stops it.
    whole = httpx.post(f"{gateway}/v1/chat/completions", json=body, timeout=60).json()
    assert whole["choices"][0]["finish_reason"] == "length"
    # Nothing else in flight (an earlier test's stream, cut off by a proxy, may still be generating to its end),
    # and vLLM publishes its metrics about once a second, later on a loaded box: take the baseline once both hold.
    idle_by = time.monotonic() + 60
    while time.monotonic() < idle_by and (_metric(vllm_url, "vllm:num_requests_running")
                                          + _metric(vllm_url, "vllm:num_requests_waiting")) > 0:
        time.sleep(0.2)
    before = _settled(lambda: _metric(vllm_url, "vllm:generation_tokens_total"))
    completed = _settled(lambda: _completed(vllm_url))
    assert completed >= 1  # the greedy run above counts, so the counter does see finished requests
    chunks = 0
    body["stream"] = True
    with httpx.Client(timeout=30) as client, client.stream("POST", f"{gateway}/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            chunks += line.startswith("data: {")
            if chunks == 2:
                break  # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and _metric(vllm_url, "vllm:num_requests_running") > 0:
        time.sleep(0.05)
    time.sleep(1.5)
    generated = _metric(vllm_url, "vllm:generation_tokens_total") - before
    assert _metric(vllm_url, "vllm:num_requests_running") == 0
    assert _completed(vllm_url) == completed, "the abandoned generation ran to its end"
    assert 1 <= generated < 230, f"vLLM generated {generated:g} of 230 tokens for a client that left after 2"
