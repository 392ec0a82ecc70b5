"""Several gateways over one set of on-demand models (fleet/decider.py): two gateway apps, each with its own event loop,
share one SQLite store and one fake swapping backend. One of them decides: a model both ask for is loaded once, a
model another gateway runs a request on is neither unloaded for room nor for idleness, and a decider that dies is
replaced within its lease."""

import contextlib
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient

from serve.gateway.app import create_app
from serve.gateway.settings import GatewaySettings, OnDemand

from tests import until

from .fakes import SwappingTriton

NAMES = ("de", "fr", "es")
pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def backend():
    return SwappingTriton(NAMES)


@contextlib.contextmanager
def gateways(backend, tmp_path, count=2, room=2.0, idle_unload_s=None, **kw):
    """`count` gateway apps on one store; the backend's gates opened again on the way out, whatever failed, so that no
    held request outlives the test."""
    settings = GatewaySettings(health_interval_s=60, swap_room_gib=room, residency_lease_s=1.0,
                               residency_store_url=f"sqlite:///{tmp_path / 'residency.sqlite'}",
                               on_demand={n: OnDemand(task="text-classification", gib=1.0, idle_unload_s=idle_unload_s)
                                          for n in NAMES}, **kw)
    with contextlib.ExitStack() as stack:
        clients = [stack.enter_context(TestClient(create_app(settings, [backend]), raise_server_exceptions=False))
                   for _ in range(count)]
        stack.callback(backend.load_gate.set)  # before the clients stop (last in, first out), which waits for them
        stack.callback(backend.gate.set)
        until(lambda: sum(c.app.state.gateway.residency.deciding for c in clients) == 1, "one gateway decides")
        yield clients
    assert not any(backend.unloaded_under), f"a model was unloaded under a request: {backend.unloads}, " \
        f"{backend.unloaded_under} requests held at each"


def residency(client):
    return client.app.state.gateway.residency


def decider_first(clients):
    """The clients, the deciding gateway's first."""
    return sorted(clients, key=lambda c: not residency(c).deciding)


def classify(client, model):
    return client.post("/v1/classify", json={"model": model, "input": "good"})


def test_a_model_every_gateway_asks_for_at_once_is_loaded_once(backend, tmp_path):
    with ThreadPoolExecutor(8) as pool, gateways(backend, tmp_path) as clients:
        backend.load_gate.clear()
        answers = [pool.submit(classify, clients[i % 2], "de") for i in range(8)]
        until(lambda: sum(residency(c).waiting["de"] for c in clients) == 8 and backend.loads == ["de"],
              "every request waiting on one load")
        backend.load_gate.set()
        assert [a.result().status_code for a in answers] == [200] * 8
        assert backend.loads == ["de"] and all(residency(c).status()["de"]["state"] == "loaded" for c in clients)


def test_room_is_made_from_a_model_no_gateway_runs_a_request_on(backend, tmp_path):
    """Room for two: fr is the least recently used, but the other gateway runs a request on it, so de makes way."""
    with ThreadPoolExecutor(2) as pool, gateways(backend, tmp_path) as clients:
        deciding, other = decider_first(clients)
        assert classify(deciding, "fr").status_code == 200 and classify(deciding, "de").status_code == 200
        backend.gate.clear()  # classify calls wait, the loaded model's first request too
        held = pool.submit(classify, other, "fr")
        until(lambda: backend.holding == 1, "the other gateway's request on fr")
        loading = pool.submit(classify, deciding, "es")
        until(lambda: backend.loads[-1:] == ["es"], "es loaded")
        assert backend.unloads == ["de"] and backend.loaded == {"fr", "es"}
        backend.gate.set()
        assert held.result().status_code == loading.result().status_code == 200


def test_a_model_another_gateway_runs_a_request_on_is_not_unloaded_for_room(backend, tmp_path):
    """Room for one, held by the other gateway's request: the load waits its bound and answers 503 saying why."""
    with ThreadPoolExecutor(2) as pool, gateways(backend, tmp_path, room=1.0, load_wait_s=1.0) as clients:
        deciding, other = decider_first(clients)
        # loaded for the other gateway within the short wait, or answered 503 while it loads (a busy machine)
        until(lambda: classify(other, "de").status_code == 200, "de loaded for the other gateway")
        backend.gate.clear()
        held = pool.submit(classify, other, "de")
        until(lambda: backend.holding == 1, "the other gateway's request on de")
        # bounded: were de unloaded, fr would load and its request wait at the closed gate
        refused = pool.submit(classify, deciding, "fr").result(timeout=20)
        assert refused.status_code == 503 and "held by models serving requests (de)" in refused.text
        assert backend.unloads == [] and backend.loaded == {"de"}
        backend.gate.set()
        assert held.result().status_code == 200
        until(lambda: classify(deciding, "fr").status_code == 200, "fr loaded once de is idle")
        assert backend.unloads == ["de"]


def test_an_idle_unload_waits_for_another_gateway_s_request_and_happens_once_it_ends(backend, tmp_path):
    with ThreadPoolExecutor(1) as pool, gateways(backend, tmp_path, idle_unload_s=0.5) as clients:
        deciding, other = decider_first(clients)
        # loaded for the other gateway within the short wait, or answered 503 while it loads (a busy machine)
        until(lambda: classify(other, "de").status_code == 200, "de loaded for the other gateway")
        backend.gate.clear()
        held = pool.submit(classify, other, "de")
        until(lambda: backend.holding == 1, "the request held on de")
        # five times the idle time (a drain takes a beat or two): still loaded, the request still runs
        with pytest.raises(AssertionError):
            until(lambda: backend.unloads, limit_s=2.5)
        assert backend.holding == 1 and backend.loaded == {"de"}
        backend.gate.set()
        assert held.result().status_code == 200
        until(lambda: backend.unloads == ["de"], "de unloaded once idle everywhere")
        assert classify(other, "de").status_code == 200 and backend.loads == ["de", "de"]


def test_a_decider_that_dies_is_replaced_within_its_lease_and_the_next_loads(backend, tmp_path, monkeypatch):
    with gateways(backend, tmp_path) as clients:
        deciding, other = decider_first(clients)
        assert classify(other, "de").status_code == 200 and backend.loads == ["de"]
        dead = residency(deciding)
        monkeypatch.setattr(dead, "_leave", lambda: None)  # dies: neither its row nor its lease is given up
        deciding.__exit__(None, None, None)
        until(lambda: residency(other).deciding, "the other gateway decides", limit_s=10)
        assert classify(other, "fr").status_code == 200 and backend.loads == ["de", "fr"]
        assert residency(other).status()["de"]["state"] == "loaded"
