"""Admission control: slots, a bounded queue, fast 503 + Retry-After past them, probes never queued."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient

from serve.gateway.app import create_app
from serve.gateway.settings import GatewaySettings

from .fakes import SlowTriton, error_of



@pytest.fixture
def busy():
    settings = GatewaySettings(max_concurrency=2, max_queue=1, queue_timeout_s=5, health_interval_s=60)
    with TestClient(create_app(settings, [SlowTriton(0.6)]), raise_server_exceptions=False) as c:
        yield c


def timed_post(client):
    start = time.perf_counter()
    r = client.post("/v1/classify", json={"model": "clf", "input": "good"})
    return r, time.perf_counter() - start


def test_past_the_slots_and_the_queue_requests_are_shed_fast(busy):
    with ThreadPoolExecutor(5) as pool:
        results = list(pool.map(lambda _: timed_post(busy), range(5)))
        live = busy.get("/healthz")  # probes are not admitted, so never queued
    codes = sorted(r.status_code for r, _ in results)
    assert codes == [200, 200, 200, 503, 503]
    for r, seconds in results:
        if r.status_code == 503:
            assert error_of(r, 503)["code"] == "overloaded" and r.headers["retry-after"] == "1"
            assert seconds < 0.3  # shed at once, not after waiting
    assert live.status_code == 200
    metrics = busy.get("/metrics").text
    assert 'rtxserve_requests_shed_total{reason="queue full"} 2.0' in metrics
    assert "rtxserve_requests_in_flight 0.0" in metrics and "rtxserve_requests_queued 0.0" in metrics


def test_a_queued_request_that_waits_too_long_is_503():
    settings = GatewaySettings(max_concurrency=1, max_queue=4, queue_timeout_s=0.2, health_interval_s=60)
    with TestClient(create_app(settings, [SlowTriton(0.6)]), raise_server_exceptions=False) as client:
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(lambda _: timed_post(client), range(2)))
    waited = [(r, s) for r, s in results if r.status_code == 503]
    assert len(waited) == 1 and 0.15 < waited[0][1] < 0.5
    assert "queue wait timed out" in error_of(waited[0][0], 503)["message"]


def test_a_model_limit_sheds_that_model_only():
    settings = GatewaySettings(model_concurrency={"clf": 1}, max_queue=0, health_interval_s=60)
    with TestClient(create_app(settings, [SlowTriton(0.6)]), raise_server_exceptions=False) as client:
        with ThreadPoolExecutor(4) as pool:
            clf = [pool.submit(timed_post, client) for _ in range(3)]
            time.sleep(0.1)
            other = client.post("/v1/embeddings", json={"model": "emb", "input": "good"})  # not limited: answers
            results = [f.result() for f in clf]
    assert other.status_code == 200
    assert sorted(r.status_code for r, _ in results) == [200, 503, 503]
    for r, seconds in results:
        if r.status_code == 503:
            assert error_of(r, 503)["message"] == "model 'clf' is at capacity (queue full); retry shortly"
            assert r.headers["retry-after"] == "1" and seconds < 0.3
    # the slot came back: the next request is served
    assert timed_post(client)[0].status_code == 200
