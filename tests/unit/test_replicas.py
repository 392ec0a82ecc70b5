"""Several replicas of a backend: least-busy routing, a dead replica's traffic moves to the live one,
connect failures tried on the next replica and nothing else retried, per-replica circuit breakers."""

from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient

from serve.gateway.exceptions import BackendConnectFailed, BackendError, BackendUnavailable
from serve.gateway.app import create_app
from serve.gateway.settings import GatewaySettings

from .fakes import SlowTriton, error_of

BODY = {"model": "clf", "input": "good"}



@pytest.fixture
def pair():
    return SlowTriton(0.3, url="a"), SlowTriton(0.3, url="b")


@pytest.fixture
def client(pair):
    settings = GatewaySettings(breaker_failures=2, breaker_reset_s=30, health_interval_s=60)
    with TestClient(create_app(settings, list(pair)), raise_server_exceptions=False) as c:
        yield c


def test_concurrent_requests_go_to_the_least_busy_replica(client, pair):
    with ThreadPoolExecutor(6) as pool:
        codes = list(pool.map(lambda _: client.post("/v1/classify", json=BODY).status_code, range(6)))
    assert codes == [200] * 6
    assert [len(b.calls) for b in pair] == [3, 3]


def test_a_dead_replica_is_routed_around_and_the_gateway_stays_ready(client, pair):
    pair[0].up = False
    client.portal.call(client.app.state.gateway.registry.refresh)
    assert all(client.post("/v1/classify", json=BODY).status_code == 200 for _ in range(4))
    assert (len(pair[0].calls), len(pair[1].calls)) == (0, 4)
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["backends"] == {"triton@a": "down", "triton@b": "up"}


def test_only_a_failed_connect_is_tried_on_another_replica(client, pair):
    pair[0].fail_with = BackendConnectFailed("refused")
    assert client.post("/v1/classify", json=BODY).status_code == 200 and len(pair[1].calls) == 1
    pair[0].fail_with, pair[1].calls = BackendError("model failed"), []
    client.app.state.gateway.registry.replicas[0].picks = -10  # make replica a the next pick
    assert error_of(client.post("/v1/classify", json=BODY), 502)["code"] == "backend_error"
    assert pair[1].calls == []  # a request that reached a backend is never sent twice


def test_a_failing_replica_opens_its_breaker_and_traffic_moves(client, pair):
    pair[0].fail_with = BackendUnavailable("broken")
    state = client.app.state.gateway
    state.registry.replicas[1].picks = 100  # replica a first while it looks as good as b
    codes = [client.post("/v1/classify", json=BODY).status_code for _ in range(6)]
    assert codes[:2] == [503, 503] and codes[2:] == [200] * 4  # two failures open a's breaker
    assert state.registry.replicas[0].breaker.opened and "breaker open" in client.get("/readyz").json()["backends"]["triton@a"]
    assert 'rtxserve_backend_breaker_open{backend="triton@a"} 1.0' in client.get("/metrics").text


def test_with_every_breaker_open_requests_get_503_with_the_wait(client, pair):
    for b in pair:
        b.fail_with = BackendUnavailable("broken")
    for _ in range(4):
        client.post("/v1/classify", json=BODY)
    r = client.post("/v1/classify", json=BODY)
    assert "no live replica" in error_of(r, 503)["message"]
    assert 20 <= int(r.headers["retry-after"]) <= 30
