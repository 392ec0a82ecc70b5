"""Admission control: slots, a bounded queue, fast 503 + Retry-After past them, probes never queued."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient

from serve.gateway.app import create_app
from serve.gateway.settings import GatewaySettings

from .fakes import GatedTriton, error_of


@pytest.fixture
def busy():
    backend = GatedTriton()
    settings = GatewaySettings(max_concurrency=2, max_queue=1, queue_timeout_s=30, health_interval_s=60)
    with TestClient(create_app(settings, [backend]), raise_server_exceptions=False) as c:
        yield c, backend


def timed_post(client):
    start = time.perf_counter()
    r = client.post("/v1/classify", json={"model": "clf", "input": "good"})
    return r, time.perf_counter() - start


def send_held(client, backend: GatedTriton, count: int, answered_while_held: int, holding: int):
    """`count` classify requests at once with the backend's gate closed; returns (the futures, the answers given
    while `holding` of them hold the backend, `answered_while_held` of them), then opens the gate. Which requests
    hold a slot is known, not guessed from how long they take."""
    backend.gate.clear()
    pool = ThreadPoolExecutor(count)
    futures = [pool.submit(timed_post, client) for _ in range(count)]
    deadline = time.monotonic() + 30
    while sum(f.done() for f in futures) < answered_while_held or backend.holding < holding:
        assert time.monotonic() < deadline, (backend.holding, [f.done() for f in futures])
        time.sleep(0.01)
    early = [f.result() for f in futures if f.done()]
    assert len(early) == answered_while_held and backend.holding == holding  # the rest still wait
    return pool, futures, early


def test_past_the_slots_and_the_queue_requests_are_shed_at_once(busy):
    client, backend = busy
    pool, futures, shed = send_held(client, backend, 5, answered_while_held=2, holding=2)  # 2 slots, 1 queued
    live = client.get("/healthz")  # probes are not admitted, so never queued
    backend.gate.set()
    results = [f.result() for f in futures]
    pool.shutdown()
    for r, _ in shed:  # shed while the slots were held: not after waiting for one
        assert r.status_code == 503 and error_of(r, 503)["code"] == "overloaded" and r.headers["retry-after"] == "1"
    assert sorted(r.status_code for r, _ in results) == [200, 200, 200, 503, 503]
    assert live.status_code == 200
    metrics = client.get("/metrics").text
    assert 'rtxserve_requests_shed_total{reason="queue full"} 2.0' in metrics
    assert "rtxserve_requests_in_flight 0.0" in metrics and "rtxserve_requests_queued 0.0" in metrics


def test_a_queued_request_that_waits_too_long_is_503():
    backend = GatedTriton()
    settings = GatewaySettings(max_concurrency=1, max_queue=4, queue_timeout_s=0.2, health_interval_s=60)
    with TestClient(create_app(settings, [backend]), raise_server_exceptions=False) as client:
        pool, futures, waited = send_held(client, backend, 2, answered_while_held=1, holding=1)
        backend.gate.set()
        served = [f.result() for f in futures if f.result() not in waited]
        pool.shutdown()
    ((r, seconds),) = waited  # answered while the slot was still held: it gave up waiting, at its timeout
    assert r.status_code == 503 and seconds >= settings.queue_timeout_s
    assert "queue wait timed out" in error_of(r, 503)["message"]
    assert [r.status_code for r, _ in served] == [200]


def test_a_model_limit_sheds_that_model_only():
    backend = GatedTriton()
    settings = GatewaySettings(model_concurrency={"clf": 1}, max_queue=0, health_interval_s=60)
    with TestClient(create_app(settings, [backend]), raise_server_exceptions=False) as client:
        pool, futures, shed = send_held(client, backend, 3, answered_while_held=2, holding=1)
        other = client.post("/v1/embeddings", json={"model": "emb", "input": "good"})  # not limited: answers
        backend.gate.set()
        results = [f.result() for f in futures]
        pool.shutdown()
        assert other.status_code == 200
        assert sorted(r.status_code for r, _ in results) == [200, 503, 503]
        for r, _ in shed:  # while the one slot was held
            assert error_of(r, 503)["message"] == "model 'clf' is at capacity (queue full); retry shortly"
            assert r.headers["retry-after"] == "1"
        # the slot came back: the next request is served
        assert timed_post(client)[0].status_code == 200
